"""Worker for tests/test_fusion.py: the Horovod collectives one training step runs through grace's
PyTorch wrapper, counted at Horovod's own asynchronous ops, for every compressor, on the shapes
given (test_fusion.SHAPES: matrices and a vector compressed, the biases dense below min_numel).

    horovodrun -np 2 python tests/workers/torch_fusion.py OUT.json COMPRESSOR,... SHAPES_JSON"""

from __future__ import annotations

import json
import sys

import horovod.torch as hvd
import torch

import grace

SHAPES = [tuple(s) for s in json.loads(sys.argv[3])]
OPS = ("allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async", "alltoall_async")

torch.set_num_threads(1)
hvd.init()
calls: list = []
counting = False


def counted(op):
    original = getattr(hvd, op)

    def call(*args, **kwargs):
        if counting:
            calls.append((op.replace("_async", ""), kwargs.get("name")))  # allreduce_: in place
        return original(*args, **kwargs)
    return call


for op in OPS:  # grace's collectives call them through the module: hvd.allreduce_async(...)
    setattr(hvd, op, counted(op))

report = {}
for name in sys.argv[2].split(","):
    torch.manual_seed(0)
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s)) for s in reversed(SHAPES))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(params.parameters(), lr=0.01),
        named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
        compression=grace.build(name, min_numel=1024))
    per_step = []
    for step in range(2):
        counting, calls[:] = True, []
        optimizer.zero_grad()
        sum((p * (hvd.rank() + step + 1.0)).square().sum() for p in params).backward()
        optimizer.step()
        counting = False
        per_step.append(list(calls))
    report[name] = per_step
if hvd.rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
