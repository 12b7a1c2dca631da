from __future__ import annotations

from grace.compressor import Compressor, compute_dtype, numel_of
from grace.validation import check_int


class Sketch(Compressor):
    """SketchML's quantile sketch for gradient values: the sorted values are cut into ``buckets``
    equal-count buckets; each element is sent as its bucket's id (one byte) and each bucket as the
    mean of its elements, so an element's error is at most its bucket's width. Jiang et al.,
    "SketchML: Accelerating Distributed Machine Learning with Data Sketches", SIGMOD 2018 (values of
    dense tensors; its MinMaxSketch for sparse keys is not needed here)."""

    name = "sketch"
    default_communicator = "allgather"

    def __init__(self, buckets: int = 256):
        self.buckets = check_int("buckets", buckets, minimum=2)
        if self.buckets > 256:
            raise ValueError(f"buckets must be in [2, 256] (ids travel as one byte), got {buckets!r}")

    def params(self):
        return {"buckets": self.buckets}

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        n, b = ctx.numel, self.buckets
        cuts = [min(n - 1, (i * n) // b) for i in range(1, b)]
        boundaries = ops.gather(ops.sort(x), ops.constant(cuts, "int32", like=flat))
        ids = ops.bucketize(x, boundaries)
        wide = ops.cast(x, "float64")  # bucket sums in float64: a bucket's mean stays inside it
        sums = ops.scatter_add(b, ids, wide)
        counts = ops.scatter_add(b, ids, ops.full(n, 1.0, "float64", like=x))
        means = ops.div(sums, ops.maximum(counts, 1.0))
        return [ops.cast(means, ctx.dtype), ops.cast(ids, "uint8")]

    def decode(self, payload, ctx, ops):
        means, ids = payload
        return ops.gather(means, ops.cast(ids, "int32"))

    def payload_nbytes(self, shape, itemsize):
        return self.buckets * itemsize + numel_of(shape)
