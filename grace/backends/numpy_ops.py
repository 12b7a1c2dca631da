"""``Ops`` over numpy arrays (host memory, no bfloat16)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from grace.ops import Ops, index_dtype


class NumpyOps(Ops):
    """The reference adapter: plain numpy, written for clarity rather than speed."""

    name = "numpy"

    def shape(self, x):
        return tuple(int(d) for d in np.shape(x))

    def dtype(self, x):
        return np.asarray(x).dtype.name

    def itemsize(self, dtype):
        if dtype == "bfloat16":
            return 2
        return np.dtype(dtype).itemsize

    def zeros(self, n, dtype, like):
        return np.zeros(n, dtype=_np_dtype(dtype))

    def flatten(self, x):
        return np.ascontiguousarray(x).reshape(-1)

    def reshape(self, x, shape: Sequence[int]):
        return np.reshape(x, tuple(shape))

    def cast(self, x, dtype):
        x = np.asarray(x)
        return x if x.dtype.name == dtype else x.astype(_np_dtype(dtype))

    def copy(self, x):
        return np.array(x, copy=True)

    def concat(self, xs):
        return np.concatenate([np.asarray(x).reshape(-1) for x in xs])

    def split(self, x, sizes):
        return np.split(np.asarray(x), np.cumsum(sizes)[:-1])

    def add(self, a, b):
        return np.add(a, b, dtype=np.result_type(a, b))

    def sub(self, a, b):
        return np.subtract(a, b, dtype=np.result_type(a, b))

    def scale(self, x, factor):
        x = np.asarray(x)
        return (x * np.asarray(factor, dtype=x.dtype)).astype(x.dtype, copy=False)

    def abs(self, x):
        return np.abs(x)

    def topk_indices(self, x, k):
        n = x.shape[0]
        idx = np.argpartition(np.abs(x), n - k)[n - k:] if k < n else np.arange(n)
        return idx.astype(index_dtype(n))

    def gather(self, x, indices):
        return np.asarray(x)[indices]

    def scatter_add(self, n, indices, values):
        out = np.zeros(n, dtype=np.asarray(values).dtype)
        np.add.at(out, np.asarray(indices, dtype=np.int64), values)
        return out

    def from_numpy(self, array, like):
        return np.asarray(array)

    def to_numpy(self, x):
        return np.asarray(x)


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        raise TypeError("the numpy reference backend has no bfloat16; use float32 or a framework tensor")
    return np.dtype(dtype)
