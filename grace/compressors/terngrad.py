from __future__ import annotations

import math

from grace.compressor import TINY, Compressor, Seeded, compute_dtype, numel_of
from grace.compressors.qsgd import level_values


class TernGrad(Seeded, Compressor):
    """TernGrad: with ``s = max |x|``, each element becomes ``s * sign(x) * b`` where ``b`` is 1 with
    probability ``|x| / s``, else 0, an unbiased estimate in {-s, 0, s}. Sent: ``s`` and the ternary
    codes, 2 bits each (sign and magnitude, as QSGD's with one level), packed. Wen et al.,
    "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning", NeurIPS
    2017 (its optional gradient clipping, which biases the estimate, is left out)."""

    name = "terngrad"
    default_communicator = "allgather"

    def __init__(self, seed: int = 0):
        self._init_seed(seed)

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        scale = ops.max_abs(x)
        # Stochastic rounding of |x| / s to 0 or 1 is keeping with probability |x| / s.
        codes = ops.quantize_levels(x, ops.maximum(scale, TINY), 1, 2,
                                    self._seed_of(name, ctx, shared=False), self.next_step(name, ops))
        return [ops.cast(scale, ctx.dtype), codes]

    def decode(self, payload, ctx, ops):
        scale, packed = payload
        values = level_values(2, ops.cast(scale, compute_dtype(ctx.dtype)), ctx, ops, like=packed)
        return ops.unpack_values(packed, 2, ctx.numel, values)

    def payload_nbytes(self, shape, itemsize):
        return itemsize + math.ceil(numel_of(shape) * 2 / 8)
