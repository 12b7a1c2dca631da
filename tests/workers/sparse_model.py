"""The embedding model of the sparse-gradient workers (tests/workers/torch_sparse.py, tf_sparse.py),
and a numpy model of it and of the exchange they test: every lookup's row, repeats added up, top-k
with error feedback on the rows."""

from __future__ import annotations

import numpy as np

TABLE, WIDTH, CLASSES, BAG, BATCH, LR = 1000, 16, 4, 5, 32, 0.5
POSITION = np.array([1.0, 0.8, 0.6, 0.45, 0.3])
"""Each of a sample's lookups weighs differently: the rows of one sample's lookups would otherwise
be equal, and top-k's choice among equal magnitudes is arbitrary."""


def batch(step: int, worker: int):
    rng = np.random.default_rng(1000 * step + worker)
    return rng.integers(0, TABLE, (BATCH, BAG)), rng.standard_normal((BATCH, CLASSES)).astype(np.float32)


def numpy_gradients(E, W, x, t):
    h = (E[x] * POSITION[None, :, None]).sum(1)
    out = h @ W.T
    d_out = 2.0 * (out - t) / out.size
    d_rows = ((d_out @ W)[:, None, :] * POSITION[None, :, None]).reshape(-1, WIDTH)  # per lookup
    return x.reshape(-1), d_rows, d_out.T @ h


def numpy_topk_rows(indices, rows, residual, ratio):
    """The exchange's reference: repeated rows added up, the residual rows added, the largest
    ``ratio`` of the elements sent, the rest kept as the residual."""
    merged = {}
    for i, r in zip(indices.tolist(), rows):
        merged[i] = merged.get(i, 0) + r
    for i, r in residual.items():
        merged[i] = merged.get(i, 0) + r
    keys = sorted(merged)
    matrix = np.stack([merged[i] for i in keys]).astype(np.float32)
    flat = matrix.reshape(-1)
    k = min(flat.size, max(16, int(ratio * flat.size)))  # grace.compressors.topk.kept
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    sent = np.zeros_like(flat)
    sent[keep] = flat[keep]
    left = (flat - sent).reshape(matrix.shape)
    return {i: s for i, s in zip(keys, sent.reshape(matrix.shape))}, dict(zip(keys, left))


def numpy_run(steps: int, ratio: float | None, size: int):
    E, W = (w.astype(np.float64) for w in initial_weights())
    residuals = [{} for _ in range(size)]
    for step in range(steps):
        total_rows = np.zeros_like(E)
        total_W = np.zeros_like(W)
        for worker in range(size):
            x, t = batch(step, worker)
            indices, rows, gW = numpy_gradients(E, W, x, t)
            total_W += gW
            if ratio is None:
                np.add.at(total_rows, indices, rows)
            else:
                sent, residuals[worker] = numpy_topk_rows(indices, rows, residuals[worker], ratio)
                for i, r in sent.items():
                    total_rows[i] += r
        E -= LR * total_rows / size
        W -= LR * total_W / size
    return E, W


def initial_weights():
    """The embedding table and the linear layer's (width x classes) weights every run starts from."""
    rng = np.random.default_rng(7)
    return (rng.standard_normal((TABLE, WIDTH)).astype(np.float32),
            (0.1 * rng.standard_normal((CLASSES, WIDTH))).astype(np.float32))
