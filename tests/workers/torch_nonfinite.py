"""Worker for tests/test_reliability.py: mixed-precision-style training with torch.amp.GradScaler
where one worker's gradient overflows at step 3.

    horovodrun -np 2 python tests/workers/torch_nonfinite.py OUTDIR

For each compressor: run ``overflow`` (rank 1's loss is Inf at step 3) and run ``skipped`` (step 3
left out everywhere, the loss scale halved as the scaler does on overflow); saves weights and the
compression state around step 3."""

from __future__ import annotations

import math
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

from tests.workers.common import LR, batch, scaled_step, torch_linear
from tests.workers.scenarios import build, names

COMPRESSORS = {name: (lambda name=name: build(name)) for name in names("torch", "nonfinite")}
COMPRESSORS["topk_unchecked"] = lambda: build("topk", check_finite=False)  # the control
OVERFLOW_STEP = 3

outdir = sys.argv[1]
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


def run(name, mode):
    model = torch_linear()
    compression = COMPRESSORS[name]()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(8):
        if mode == "skipped" and step == OVERFLOW_STEP:
            # The same loss-scale trajectory as the run that overflowed, without the step.
            scaler.update(new_scale=scaler.get_scale() / 2)
            continue
        if mode == "overflow" and step == OVERFLOW_STEP:
            torch.save(compression.state_dict(), os.path.join(outdir, f"{name}.before.rank{rank}.pt"))
            weight_before = model.weight.detach().clone()
            scale_before = scaler.get_scale()
        x, y = (torch.from_numpy(a) for a in batch(rank, step))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if mode == "overflow" and step == OVERFLOW_STEP and rank == 1:
            loss = loss * math.inf
        scaled_step(optimizer, scaler, loss)
        if mode == "overflow" and step == OVERFLOW_STEP:
            torch.save(compression.state_dict(), os.path.join(outdir, f"{name}.after.rank{rank}.pt"))
            unchanged = bool(torch.equal(model.weight, weight_before))
            with open(os.path.join(outdir, f"{name}.skip.rank{rank}.txt"), "w") as f:
                f.write(f"{int(unchanged)} {scale_before} {scaler.get_scale()}")
    np.savez(os.path.join(outdir, f"{name}.{mode}.rank{rank}.npz"),
             w=model.weight.detach().numpy(), b=model.bias.detach().numpy())


for name in COMPRESSORS:
    run(name, "overflow")
    run(name, "skipped")


# --- an Inf in one layer only, on one worker ------------------------------------------------------
# Two compressed layers; a tensor hook makes the second layer's gradient Inf on rank 1 at
# OVERFLOW_STEP. The loss scaler skips the whole step, so no layer's state may absorb it.
ONE_LAYER = ("topk", "dgc", "powersgd", "randomk", "onebit")


def two_layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(160, 32), torch.nn.Tanh(), torch.nn.Linear(32, 40))


def run_one_layer(name, mode):
    model = two_layers()
    compression = build(name)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5),
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
    overflowing = {"now": False}
    model[2].weight.register_hook(lambda g: g * math.inf if overflowing["now"] else g)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(8):
        if mode == "skipped" and step == OVERFLOW_STEP:
            scaler.update(new_scale=scaler.get_scale() / 2)
            continue
        overflowing["now"] = mode == "overflow" and step == OVERFLOW_STEP and rank == 1
        if mode == "overflow" and step == OVERFLOW_STEP:
            torch.save(compression.state_dict(),
                       os.path.join(outdir, f"layer_{name}.before.rank{rank}.pt"))
        x, y = (torch.from_numpy(a) for a in batch(rank, step))
        optimizer.zero_grad()
        scaled_step(optimizer, scaler, torch.nn.functional.mse_loss(model(x)[:, :8], y))
        if mode == "overflow" and step == OVERFLOW_STEP:
            torch.save(compression.state_dict(), os.path.join(outdir, f"layer_{name}.after.rank{rank}.pt"))
    np.savez(os.path.join(outdir, f"layer_{name}.{mode}.rank{rank}.npz"),
             **{k.replace(".", "_"): v.detach().numpy() for k, v in model.state_dict().items()})


for name in ONE_LAYER:
    run_one_layer(name, "overflow")
    run_one_layer(name, "skipped")
