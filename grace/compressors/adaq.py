from __future__ import annotations

from grace.compressor import Compressor, Seeded, compute_dtype
from grace.validation import check_ratio


class AdaQ(Seeded, Compressor):
    """Adaptive quantization: for the positive and the negative elements separately, a threshold is
    estimated from a random sample so that about ``ratio`` of each sign lies beyond it; the elements
    beyond are sent as indices only, and each sign as one value, the mean of its sent elements.
    Error feedback keeps the rest and the quantization error. Dryden et al., "Communication
    Quantization for Data-parallel Training of Deep Neural Networks", MLHPC 2016."""

    name = "adaq"
    default_memory = "residual"
    default_communicator = "allgather"
    fixed_size = False

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01, seed: int = 0):
        self.ratio = check_ratio("ratio", ratio)
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio)
        self._init_seed(seed)

    def params(self):
        return {"ratio": self.ratio, "sample_ratio": self.sample_ratio, "seed": self.seed}

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        n = ctx.numel
        m = min(n, max(1, int(n * self.sample_ratio), 256))
        picked = self.indices(n, m, name, ctx, ops, like=flat)
        sample = ops.sort(ops.gather(x, picked))
        k = max(1, int(m * self.ratio))
        top = ops.gather(sample, ops.constant([m - k], "int32", like=flat))
        bottom = ops.gather(sample, ops.constant([k - 1], "int32", like=flat))
        zero = ops.zeros(n, ops.dtype(x), like=x)
        false = ops.less(zero, zero)
        # beyond the threshold and of that sign (a threshold of the wrong sign selects nothing more)
        positive = ops.where(ops.greater_equal(x, top), ops.less(zero, x), false)
        negative = ops.where(ops.greater_equal(bottom, x), ops.less(x, zero), false)
        means = []
        for mask in (positive, negative):
            count = ops.sum(ops.cast(mask, ops.dtype(x)))
            means.append(ops.div(ops.sum(ops.where(mask, x, zero)), ops.maximum(count, 1.0)))
        return [ops.cast(ops.concat(means), ctx.dtype), ops.nonzero(positive), ops.nonzero(negative)]

    def decode(self, payload, ctx, ops):
        means, positive, negative = payload
        mean_pos, mean_neg = ops.split(means, [1, 1])
        ones = ops.full(ctx.numel, 1.0, ctx.dtype, like=means)
        up = ops.scatter_add(ctx.numel, positive, ops.gather(ops.mul(ones, mean_pos), positive))
        down = ops.scatter_add(ctx.numel, negative, ops.gather(ops.mul(ones, mean_neg), negative))
        return ops.add(up, down)
