"""Worker for tests/test_takeover.py: the optimizer takeovers (grace.takeover) where a user's script
does more than step: a resume through ``optimizer.state_dict()``, a loss scaler that skips a step,
``hvd.broadcast_optimizer_state``, learning-rate and momentum schedules, weight decay. common.py's
linear model, 2 workers, 10 steps.

    horovodrun -np 2 python tests/workers/torch_takeover.py OUTDIR

Each scenario saves each rank's final weights, and the learning rate and momentum of each step
where a schedule changes them."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

import horovod.torch as hvd
import numpy as np
import torch

import grace
from tests.workers.common import LR, batch, scaled_step, torch_linear, train_linear

STEPS, RESUME_AT, OVERFLOW_STEP = 10, 5, 3

outdir = sys.argv[1]
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


def randomk() -> grace.Pipeline:
    return grace.randomk(0.05, seed=3, min_kept=1)


def wrap(model, optimizer, compression):
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                    compression=compression)


def save(name: str, model, **info) -> None:
    np.savez(os.path.join(outdir, f"{name}.rank{rank}.npz"), w=model.weight.detach().numpy(),
             b=model.bias.detach().numpy())
    with open(os.path.join(outdir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(info, f)


def adam_resumed():
    """Random-k over Adam, 5 steps, ``optimizer.state_dict()`` and the weights saved; then a new
    model, optimizer and compression load them and take steps 5-9."""
    model = torch_linear()
    optimizer = wrap(model, torch.optim.Adam(model.parameters(), 0.01), randomk())
    train_linear(model, optimizer, rank, RESUME_AT)
    path = os.path.join(outdir, f"adam_resume.rank{rank}.pt")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    model = torch_linear(seed=1)  # other weights: the checkpoint must bring them back
    optimizer = wrap(model, torch.optim.Adam(model.parameters(), 0.01), randomk())
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    train_linear(model, optimizer, rank, STEPS, first=RESUME_AT)
    save("adam_resume", model)


def adam_scheduled():
    """Random-k over Adam under ``LambdaLR``: the learning rate of each step is the scheduler's."""
    model = torch_linear()
    optimizer = wrap(model, torch.optim.Adam(model.parameters(), 0.01), randomk())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    rates = []
    for step in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        train_linear(model, optimizer, rank, step + 1, first=step)
        scheduler.step()
    save("adam_scheduled", model, rates=rates)


def adam_broadcast():
    """Each worker built with its own learning rate (0.01 on rank 0, 0.05 on rank 1), then
    ``hvd.broadcast_optimizer_state`` (which initialises Adam's state with a step of zero
    gradients): rank 0's settings everywhere."""
    model = torch_linear()
    optimizer = wrap(model, torch.optim.Adam(model.parameters(), 0.01 if rank == 0 else 0.05),
                     randomk())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    rate = optimizer.param_groups[0]["lr"]
    train_linear(model, optimizer, rank, STEPS)
    save("adam_broadcast", model, lr=rate,
         adam_steps={n: int(s["step"]) for n, s in ((optimizer._parameter_names[p], s)
                                                    for p, s in optimizer.state.items())})


def adam_scaled(mode: str):
    """Random-k over Adam under ``torch.amp.GradScaler``: ``overflow``, rank 1's loss is Inf at
    step 3 (the scaler skips the step on every worker); ``skipped``, step 3 left out everywhere
    with the scale halved as the scaler does on overflow."""
    model = torch_linear()
    optimizer = wrap(model, torch.optim.Adam(model.parameters(), 0.01), randomk())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    skipped = None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if mode == "skipped" and step == OVERFLOW_STEP:
                scaler.update(new_scale=scaler.get_scale() / 2)
                continue
            x, y = (torch.from_numpy(a) for a in batch(rank, step))
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if mode == "overflow" and step == OVERFLOW_STEP and rank == 1:
                loss = loss * math.inf
            before = model.weight.detach().clone()
            scaled_step(optimizer, scaler, loss)
            if step == OVERFLOW_STEP:
                skipped = bool(torch.equal(model.weight, before))
    save(f"adam_{mode}", model, unchanged_at_overflow=skipped,
         warnings=[str(w.message) for w in said if str(w.message).startswith("grace:")])


def sgd_scheduled(name: str, compression, weight_decay: float = 0.0, one_cycle: bool = True):
    """SGD with momentum 0.9 taken over by ``compression``; with ``one_cycle``, ``OneCycleLR``
    cycling the learning rate and the momentum (0.85-0.95) step by step."""
    model = torch_linear()
    optimizer = wrap(model, torch.optim.SGD(model.parameters(), LR, momentum=0.9,
                                            weight_decay=weight_decay), compression)
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=STEPS,
                                                     base_momentum=0.85, max_momentum=0.95)
                 if one_cycle else None)
    rates, momenta = [], []
    for step in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        momenta.append(optimizer.param_groups[0]["momentum"])
        train_linear(model, optimizer, rank, step + 1, first=step)
        if scheduler is not None:
            scheduler.step()
    save(name, model, rates=rates, momenta=momenta)


adam_resumed()
adam_scheduled()
adam_broadcast()
adam_scaled("overflow")
adam_scaled("skipped")
sgd_scheduled("dgc_one_cycle", grace.dgc(0.05, sample_ratio=1.0))
sgd_scheduled("dgc_weight_decay", grace.dgc(0.05, sample_ratio=1.0), weight_decay=0.05,
              one_cycle=False)
sgd_scheduled("randomk_weight_decay", randomk(), weight_decay=0.05, one_cycle=False)
