"""Worker for tests/test_reliability.py: workers that differ, a parameter that only some workers
use in a step, a worker that dies.

    horovodrun -np 2 python tests/workers/torch_mismatch.py OUTDIR SCENARIO"""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

import grace

outdir, scenario = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()
torch.manual_seed(0)


class TwoHeads(torch.nn.Module):
    def __init__(self, width=1200):
        super().__init__()
        self.body = torch.nn.Linear(16, width)
        self.head_a = torch.nn.Linear(width, 2)
        self.head_b = torch.nn.Linear(width, 2)

    def forward(self, x, use_b=True):
        h = self.body(x)
        return self.head_a(h) + (self.head_b(h) if use_b else 0)


compression = grace.topk(0.01 if scenario != "compressor" or rank == 0 else 0.02)
model = TwoHeads(width=1200 if scenario != "shape" or rank == 0 else 1300)
if scenario == "names" and rank == 1:
    model.extra = torch.nn.Linear(4, 4)
try:
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
except ValueError as error:
    with open(os.path.join(outdir, f"{scenario}.error.rank{rank}.txt"), "w") as f:
        f.write(str(error))
    sys.exit(0)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

rng = np.random.default_rng(rank)
for step in range(6):
    if scenario == "dies" and step == 3 and rank == 1:
        os._exit(3)
    x = torch.from_numpy(rng.standard_normal((8, 16)).astype(np.float32))
    optimizer.zero_grad()
    # "unused": worker 1 leaves head_b out of steps 2 and 3, so only worker 0 has its gradient.
    use_b = not (scenario == "unused" and rank == 1 and step in (2, 3))
    model(x, use_b).pow(2).mean().backward()
    optimizer.step()
np.savez(os.path.join(outdir, f"{scenario}.rank{rank}.npz"),
         **{k: v.detach().numpy() for k, v in model.state_dict().items()})
