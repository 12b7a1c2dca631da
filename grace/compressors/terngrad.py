from __future__ import annotations

import math

from grace.compressor import TINY, Compressor, Seeded, compute_dtype, numel_of


class TernGrad(Seeded, Compressor):
    """TernGrad: with ``s = max |x|``, each element becomes ``s * sign(x) * b`` where ``b`` is 1 with
    probability ``|x| / s``, else 0, an unbiased estimate in {-s, 0, s}. Sent: ``s`` and the ternary
    codes, 2 bits each, packed. Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning", NeurIPS 2017 (its optional gradient clipping, which biases the
    estimate, is left out)."""

    name = "terngrad"
    default_communicator = "allgather"

    def __init__(self, seed: int = 0):
        self._init_seed(seed)

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        scale = ops.max(ops.abs(x))
        probability = ops.div(ops.abs(x), ops.maximum(scale, TINY))
        uniform = self.uniform(ctx.numel, name, ctx, ops, like=flat)
        keep = ops.cast(ops.less(ops.cast(uniform, ops.dtype(x)), probability), ops.dtype(x))
        codes = ops.cast(ops.add(ops.mul(ops.sign(x), keep), ops.full(ctx.numel, 1.0, ops.dtype(x),
                                                                      like=x)), "int32")
        return [ops.cast(scale, ctx.dtype), ops.pack_bits(codes, 2)]

    def decode(self, payload, ctx, ops):
        scale, packed = payload
        dtype = compute_dtype(ctx.dtype)
        # Codes 0, 1, 2 are -s, 0, s (3 never occurs): decoded through that table.
        ternary = ops.constant([-1.0, 0.0, 1.0, 2.0], dtype, like=packed)
        values = ops.cast(ops.mul(ternary, ops.cast(scale, dtype)), ctx.dtype)
        return ops.unpack_values(packed, 2, ctx.numel, values)

    def payload_nbytes(self, shape, itemsize):
        return itemsize + math.ceil(numel_of(shape) * 2 / 8)
