"""Worker for tests/test_stats.py: every byte that grace puts into Horovod's collectives, counted by
wrapping horovod.torch's collective functions, against ``stats()``, for every communicator.

    horovodrun -np N python tests/workers/torch_stats.py OUT.json"""

from __future__ import annotations

import json
import sys

import horovod.torch as hvd
import torch

import grace

COUNTED = {"bytes": 0}


def counting(function):
    def wrapped(tensor, *args, **kwargs):
        name = kwargs.get("name") or ""
        if name.startswith("grace."):  # grace's own traffic, not the test's barrier and gathers
            COUNTED["bytes"] += tensor.numel() * tensor.element_size()
        return function(tensor, *args, **kwargs)
    return wrapped


for function in ("allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async"):
    setattr(hvd, function, counting(getattr(hvd, function)))

CASES = {
    "none": lambda: grace.none(),                       # Horovod's in-place allreduce (as is)
    "fp16": lambda: grace.fp16(),                       # allreduce of casts
    "randomk": lambda: grace.randomk(0.05, min_kept=1),  # allreduce, shared indices
    "powersgd": lambda: grace.powersgd(rank=2),         # two allreduce rounds
    "topk": lambda: grace.topk(0.05),                   # allgather, fixed sizes
    "threshold": lambda: grace.threshold(0.01),         # allgather with lengths
    "adaq": lambda: grace.adaq(0.05),                   # allgather with lengths, three parts
    "qsgd": lambda: grace.qsgd(),                       # allgather of bits and norms
    "topk_broadcast": lambda: grace.topk(0.05, communicator="broadcast"),
    "signsgd_broadcast": lambda: grace.signsgd(communicator="broadcast"),
    "dgc_warmup": lambda: grace.dgc(0.05, warmup_steps=2),  # dense, then compressed
    "inceptionn": lambda: grace.inceptionn(),           # agreed: encoded, with lengths
    "inceptionn_dense": lambda: grace.inceptionn(error_bound=2.0**-30),  # agreed: dense allreduce
}

torch.set_num_threads(1)
hvd.init()
results = {}
for name, make in CASES.items():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 32))
    compression = make()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
    before = COUNTED["bytes"]
    generator = torch.Generator().manual_seed(hvd.rank())
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(16, 64, generator=generator)).square().mean().backward()
        optimizer.step()
    stats = compression.stats()
    results[name] = {"counted": COUNTED["bytes"] - before,
                     "stats": stats["bytes_sent"] + stats["bytes_control"], **stats}
gathered = hvd.allgather_object(results)
if hvd.rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(gathered, f, indent=1)
