"""``grace.ops.Ops`` over torch tensors, on the tensor's own device (CPU or CUDA)."""

from __future__ import annotations

import torch

from grace.ops import Ops, index_dtype


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class TorchOps(Ops):
    name = "torch"

    def shape(self, x):
        return tuple(x.shape)

    def dtype(self, x):
        return str(x.dtype).removeprefix("torch.")

    def numel(self, x):
        return x.numel()

    def itemsize(self, dtype):
        return _dtype(dtype).itemsize

    def nbytes(self, x):
        return x.numel() * x.element_size()

    def zeros(self, n, dtype, like):
        return torch.zeros(n, dtype=_dtype(dtype), device=like.device)

    def flatten(self, x):
        return x.reshape(-1)

    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def cast(self, x, dtype):
        target = _dtype(dtype)
        return x if x.dtype == target else x.to(target)

    def copy(self, x):
        return x.clone()

    def concat(self, xs):
        return torch.cat([x.reshape(-1) for x in xs])

    def split(self, x, sizes):
        return list(torch.split(x, list(sizes)))

    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def scale(self, x, factor):
        return x * factor

    def abs(self, x):
        return x.abs()

    def topk_indices(self, x, k):
        indices = torch.topk(x.abs(), k, sorted=False).indices
        return indices.to(_dtype(index_dtype(x.numel())))

    def gather(self, x, indices):
        return torch.index_select(x, 0, indices)

    def scatter_add(self, n, indices, values):
        out = torch.zeros(n, dtype=values.dtype, device=values.device)
        return out.index_add_(0, indices, values)

    def from_numpy(self, array, like):
        return torch.from_numpy(array).to(like.device)

    def to_numpy(self, x):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
