"""Worker for tests/test_reliability.py: PyTorch training checkpointed and resumed.

    horovodrun -np 2 python tests/workers/torch_resume.py OUTDIR PHASE

PHASE: ``full`` trains 10 steps; ``first`` trains 5 and saves each rank's checkpoint; ``second``
loads it in a new process and trains steps 5..9 (``without_state``: the same without the compression
state); ``elastic`` trains 5, saves a
``hvd.elastic.TorchState``, trains 3 more, restores the state and trains steps 5..9."""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

from tests.workers.common import LR, torch_linear, train_linear
from tests.workers.scenarios import build as build_compression
from tests.workers.scenarios import names

outdir, phase = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


def build(name):
    model = torch_linear()
    # Momentum 0.5: the compressors that own the momentum take it over, and resume with it.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=build_compression(name))
    return model, optimizer


def steps(model, optimizer, first, last):
    train_linear(model, optimizer, rank, last, first)


for name in names("torch", "resume"):
    model, optimizer = build(name)
    checkpoint = os.path.join(outdir, f"{name}.rank{rank}.pt")
    if phase == "full":
        steps(model, optimizer, 0, 10)
    elif phase == "first":
        steps(model, optimizer, 0, 5)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
        continue
    elif phase in ("second", "without_state"):
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        if phase == "without_state":  # the control: what resuming without compression state does
            del saved["optimizer"]["grace"]
        optimizer.load_state_dict(saved["optimizer"])
        steps(model, optimizer, 5, 10)
    else:
        steps(model, optimizer, 0, 5)
        state = hvd.elastic.TorchState(model=model, optimizer=optimizer)
        state.save()
        steps(model, optimizer, 5, 8)  # work that a failure throws away
        state.restore()
        steps(model, optimizer, 5, 10)
    np.savez(os.path.join(outdir, f"{name}.{phase}.rank{rank}.npz"),
             w=model.weight.detach().numpy(), b=model.bias.detach().numpy())
