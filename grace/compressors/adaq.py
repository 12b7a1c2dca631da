from __future__ import annotations

from grace.compressor import Compressor, Seeded, compute_dtype
from grace.ops import index_dtype
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
        k = max(1, int(m * self.ratio))
        top, bottom = ops.split(ops.order_statistics(ops.gather(x, picked), [m - k, k - 1]), [1, 1])
        dtype = ops.dtype(x)
        fast = ops.fused("two_sided", x, top, bottom)
        if fast is not None:
            up, down, sums, counts = fast
            index = index_dtype(n)
            sums, counts = ops.cast(sums, dtype), ops.cast(counts, dtype)
            means = ops.div(sums, ops.maximum(counts, 1.0))
            return [ops.cast(means, ctx.dtype), ops.cast(up, index), ops.cast(down, index)]
        zero = ops.zeros(n, dtype, like=x)
        false = ops.less(zero, zero)
        # beyond the threshold and of that sign (a threshold of the wrong sign selects nothing more)
        positive = ops.where(ops.greater_equal(x, top), ops.less(zero, x), false)
        negative = ops.where(ops.greater_equal(bottom, x), ops.less(x, zero), false)
        means = []
        for mask in (positive, negative):
            count = ops.sum(ops.cast(mask, dtype))
            means.append(ops.div(ops.sum(ops.where(mask, x, zero)), ops.maximum(count, 1.0)))
        return [ops.cast(ops.concat(means), ctx.dtype), ops.nonzero(positive), ops.nonzero(negative)]

    def decode(self, payload, ctx, ops):
        means, positive, negative = payload
        mean_pos, mean_neg = ops.split(means, [1, 1])
        indices = ops.concat([positive, negative])
        # One value per sent index (an index is >= 0, so the mask is all ones): no full-size tensor.
        values = ops.concat([ops.mul(ops.cast(ops.greater_equal(positive, 0), ctx.dtype), mean_pos),
                             ops.mul(ops.cast(ops.greater_equal(negative, 0), ctx.dtype), mean_neg)])
        return ops.scatter_add(ctx.numel, indices, values)
