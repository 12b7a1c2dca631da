"""Data and initial weights shared by the worker scripts and the numpy reference models: a linear
regression whose per-worker batches are drawn from seeded numpy generators."""

from __future__ import annotations

import numpy as np

IN, OUT, BATCH = 160, 8, 16  # W has 1280 elements (compressed), b has 8 (dense below min_numel)
LR = 0.1
# The sign methods move every weight by +-lr: on this small linear model, whose gradients are ~0.1,
# 0.002 takes ten steps downhill where LR (0.1) would overshoot; grace.compressors.sign gives the
# rate measured for real models.
CATALOGUE_LR = {"signsgd": 0.002, "signum": 0.002}


def init_weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((OUT, IN)) * 0.1).astype(np.float32), np.zeros(OUT, np.float32)


def batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * rank + step + 1)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = (x[:, :OUT] * 2.0 + rng.standard_normal((BATCH, OUT)) * 0.1).astype(np.float32)
    return x, y


def gradients(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Gradients of mean((x w^T + b - y)^2), computed in float64."""
    w, b, x, y = (a.astype(np.float64) for a in (w, b, x, y))
    err = x @ w.T + b - y
    scale = 2.0 / err.size
    return scale * err.T @ x, scale * err.sum(axis=0)


def loss(w: np.ndarray, b: np.ndarray, ranks=(0, 1), steps: int = 10) -> float:
    """The mean squared error over all the batches the workers trained on."""
    errors = [np.mean((x @ w.T + b - y) ** 2) for r in ranks for x, y in (batch(r, s) for s in range(steps))]
    return float(np.mean(errors))


def torch_linear(seed: int = 0):
    """The model as a torch ``Linear`` holding ``init_weights(seed)`` (torch is imported here, so
    that the numpy reference models never need it)."""
    import torch

    w, b = init_weights(seed)
    model = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(w))
        model.bias.copy_(torch.from_numpy(b))
    return model


def scaled_step(optimizer, scaler, loss) -> None:
    """A step of a Horovod ``DistributedOptimizer`` under a loss scaler, as the docs show: the
    combined gradients are unscaled, and the step is skipped where they are not finite."""
    scaler.scale(loss).backward()
    optimizer.synchronize()
    scaler.unscale_(optimizer)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()


def train_linear(model, optimizer, rank: int, steps: int, first: int = 0) -> None:
    """Steps ``first..steps-1`` of mean-squared-error training on this rank's batches."""
    import torch

    for step in range(first, steps):
        x, y = (torch.from_numpy(a) for a in batch(rank, step))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
