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

    def slice(self, x, start, length):
        start = int(start)
        return np.asarray(x)[start:start + int(length)]

    def strided(self, x, stride):
        return np.asarray(x)[::stride]

    def to_bytes(self, x):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)

    def from_bytes(self, b, dtype):
        return np.array(b, dtype=np.uint8, copy=True).view(_np_dtype(dtype))

    def add(self, a, b):
        return np.add(a, b, dtype=np.result_type(a, b))

    def sub(self, a, b):
        return np.subtract(a, b, dtype=np.result_type(a, b))

    def scale(self, x, factor):
        x = np.asarray(x)
        wide = np.float32 if x.dtype == np.float16 else x.dtype
        return (x.astype(wide) * np.asarray(factor, dtype=wide)).astype(x.dtype, copy=False)

    def abs(self, x):
        return np.abs(x)

    def full_topk_indices(self, x, k):
        n = x.shape[0]
        idx = np.sort(np.argpartition(np.abs(x), n - k)[n - k:]) if k < n else np.arange(n)
        return idx.astype(index_dtype(n))

    def gather(self, x, indices):
        return np.asarray(x)[indices]

    def scatter_add(self, n, indices, values):
        out = np.zeros(n, dtype=np.asarray(values).dtype)
        np.add.at(out, np.asarray(indices, dtype=np.int64), values)
        return out

    def unique(self, x):
        values, inverse = np.unique(np.asarray(x), return_inverse=True)
        return values, inverse.reshape(-1).astype(np.int64)

    def divmod(self, x, divisor):
        return np.divmod(np.asarray(x), divisor)

    def add_rows(self, count, positions, rows):
        rows = np.asarray(rows)
        out = np.zeros((int(count), rows.shape[1]), dtype=rows.dtype)
        np.add.at(out, np.asarray(positions, dtype=np.int64), rows)
        return out

    def zero_at(self, x, indices, overwrite=False, after=()):
        out = x if overwrite and isinstance(x, np.ndarray) and x.flags.writeable else np.array(x, copy=True)
        out[np.asarray(indices, dtype=np.int64)] = 0
        return out

    def full(self, n, value, dtype, like):
        return np.full(n, value, dtype=_np_dtype(dtype))

    def arange(self, n, dtype, like):
        return np.arange(n, dtype=_np_dtype(dtype))

    def constant(self, values, dtype, like):
        return np.asarray(values, dtype=_np_dtype(dtype)).reshape(-1)

    def mul(self, a, b):
        return _same(np.multiply(a, b), a)

    def div(self, a, b):
        return _same(np.divide(a, b), a)

    def sign(self, x):
        return np.sign(x)

    def where(self, cond, a, b):
        out = np.where(cond, a, b)
        return out.astype(np.result_type(a, b), copy=False)

    def greater_equal(self, a, b):
        return np.greater_equal(a, b)

    def less(self, a, b):
        return np.less(a, b)

    def equal(self, a, b):
        return np.equal(a, b)

    def floor(self, x):
        return np.floor(x)

    def round(self, x):
        return np.round(x)

    def exponent_bits(self, x):
        return ((np.asarray(x, np.float32).view(np.int32) >> 23) & 0xFF).astype(np.int32)

    def power_of_two(self, exponent):
        return (np.asarray(exponent, np.int32) << 23).view(np.float32)

    def bucketize(self, x, boundaries):
        return np.searchsorted(boundaries, x, side="right").astype(np.int32)

    def sqrt(self, x):
        return np.sqrt(x)

    def maximum(self, a, b):
        return _same(np.maximum(a, b), a)

    def minimum(self, a, b):
        return _same(np.minimum(a, b), a)

    def sum(self, x):
        x = np.asarray(x)
        wide = np.float64 if x.dtype.kind == "f" else x.dtype
        return np.sum(x, dtype=wide).astype(x.dtype).reshape(1)

    def max(self, x):
        x = np.asarray(x)
        return (np.max(x) if x.size else np.zeros((), x.dtype)).reshape(1)

    def nonfinite_flag(self, x):
        return np.array([0.0 if np.isfinite(x).all() else 1.0], np.float32)

    def nonzero(self, mask):
        return np.flatnonzero(mask).astype(index_dtype(np.size(mask)))

    def sort(self, x):
        return np.sort(x)

    def cond(self, pred, true_fn, false_fn):
        return true_fn() if bool(np.all(pred)) else false_fn()

    def pack_bits(self, codes, bits):
        planes = (np.asarray(codes, np.int64)[:, None] >> np.arange(bits)) & 1
        return np.packbits(planes.reshape(-1).astype(np.uint8), bitorder="little")

    def unpack_bits(self, packed, bits, n):
        planes = np.unpackbits(np.asarray(packed, np.uint8), bitorder="little", count=n * bits)
        return (planes.reshape(n, bits).astype(np.int32) << np.arange(bits, dtype=np.int32)).sum(1)

    def matmul(self, a, b, transpose_a=False, transpose_b=False, subtract_from=None):
        product = np.matmul(a.T if transpose_a else a, b.T if transpose_b else b)
        return product if subtract_from is None else self.sub(subtract_from, product)

    def orthogonalize(self, x):
        return np.linalg.qr(x)[0].astype(x.dtype, copy=False)

    def from_numpy(self, array, like):
        return np.asarray(array)

    def to_numpy(self, x):
        return np.asarray(x)


def _same(result, like):
    """Keep ``like``'s dtype where numpy would promote (a float32 array times a Python float)."""
    dtype = np.asarray(like).dtype
    return result.astype(dtype, copy=False) if dtype.kind == "f" else result


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        raise TypeError("the numpy reference backend has no bfloat16; use float32 or a framework tensor")
    return np.dtype(dtype)
