from __future__ import annotations

from functools import lru_cache

import numpy as np

from grace import native, steps
from grace.compressor import Compressor, Seeded, compute_dtype, numel_of, renamed
from grace.kernels import accelerated
from grace.validation import check_int

SAMPLE = 1 << 16
"""Larger tensors take their bins' boundaries from a uniform random sample of this many elements
(sorting all of a large gradient would cost more than sending it)."""


class Sketch(Seeded, Compressor):
    """SketchML's quantile sketch for gradient values: the values are cut at their quantiles into
    ``bins`` equal-count bins (SketchML's buckets); each element is sent as its bin's id (one
    byte) and each bin as the mean of its elements, so an element's error is at most its bin's
    width. The quantiles are exact up to ``SAMPLE`` elements and, above, those of a uniform random
    sample of ``SAMPLE`` elements (a sketch's estimate, as in SketchML). Jiang et al.,
    "SketchML: Accelerating Distributed Machine Learning with Data Sketches", SIGMOD 2018 (values of
    dense tensors; its MinMaxSketch for sparse keys is not needed here). A bin's mean is a
    biased estimate of its elements, so what it rounds away is kept as error feedback (the
    ``residual`` memory, the default): without it the word model's perplexity rose after its
    first epochs to 313.8 against fp32's 162.7, with it 159.8 (docs/quality.md)."""

    name = "sketch"
    default_memory = "residual"
    default_communicator = "allgather"

    def __init__(self, bins: int = 256, seed: int = 0, buckets: int | None = None):
        bins = renamed("bins", bins, buckets, 256)
        self.bins = check_int("bins", bins, minimum=2)
        if self.bins > 256:
            raise ValueError(f"bins must be in [2, 256] (ids travel as one byte), got {bins!r}")
        self._init_seed(seed)

    def params(self):
        return {"bins": self.bins, "seed": self.seed}

    def compress_flat(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        n, b = ctx.numel, self.bins
        m = min(n, SAMPLE)
        sample = x if m == n else ops.gather(x, self.indices(n, m, name, ctx, ops, like=flat))
        boundaries = ops.gather(ops.sort(sample), ops.constant(_cuts(m, b).copy(), "int32", like=flat))
        ids, sums, counts = bin_sums(ops, x, boundaries)
        means = ops.div(sums, ops.maximum(counts, 1.0))
        return [ops.cast(means, ctx.dtype), ids]

    def decompress_flat(self, payload, ctx, ops):
        means, ids = payload
        return steps.unpack_values(ops, ids, means, bits=8, n=ctx.numel)

    def payload_nbytes(self, shape, itemsize):
        return self.bins * itemsize + numel_of(shape)


@lru_cache(maxsize=64)
def _cuts(m: int, bins: int) -> np.ndarray:
    """The ranks, in a sorted sample of ``m``, of the boundaries between ``bins`` equal-count
    bins."""
    return np.minimum(m - 1, (np.arange(1, bins, dtype=np.int64) * m) // bins).astype(np.int32)


# The loop of sketch.c beside this file: each element's bin, and the bins' sums and counts.
BIN_SUMS_LOOP = native.Loop("grace_bin_sums", (
    native.In(0), native.START, native.COUNT, native.In(1), native.In(2), native.In(3),
    native.Param("shift", native.INT), native.Param("bins", native.INT32),
    native.Out(0), native.Row(1), native.Row(2)))


def _bin_sums_loop(x: np.ndarray, boundaries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For float32 ``x``: each element's bin (how many of at most 255 ``boundaries`` are <= it)
    as a byte, and per bin the float64 sum and count of its elements."""
    n = x.size
    table, low, high, shift = native.bin_index(boundaries, 16 if n >= 1 << 17 else 14)
    ids = native.empty(n, np.uint8)
    parts = native.parts(n)
    sums, counts = np.zeros((parts, len(table))), np.zeros((parts, len(table)))
    native.run(BIN_SUMS_LOOP, n, [x, table, low, high], [ids, sums, counts],
               {"shift": shift, "bins": len(table)})
    return ids, sums.sum(0), counts.sum(0)


native.register("bin_sums", native.Kernel(_bin_sums_loop, lambda x, boundaries: [
    ("uint8", x), ("float64", (boundaries[0] + 1,)), ("float64", (boundaries[0] + 1,))],
    native.float32_at(0, 1)))


@accelerated("bin_sums")
def bin_sums(ops, x, boundaries):
    """Each element's bin among the ascending ``boundaries`` (uint8), and each of the
    ``len(boundaries) + 1`` bins' float64 sum and count (``Ops.bucketize``: the bin's index, as
    torch names it)."""
    b = ops.numel(boundaries) + 1
    ids = ops.cast(ops.bucketize(x, boundaries), "uint8")
    wide = ops.cast(x, "float64")  # bin sums in float64: a bin's mean stays inside it
    sums = ops.scatter_add(b, ops.cast(ids, "int32"), wide)
    counts = ops.scatter_add(b, ops.cast(ids, "int32"), ops.full(ops.numel(x), 1.0, "float64", like=x))
    return ids, sums, counts
