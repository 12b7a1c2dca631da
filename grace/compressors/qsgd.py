from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from grace.compressor import TINY, Compressor, Seeded, compute_dtype, numel_of
from grace.validation import check_int


class QSGD(Seeded, Compressor):
    """QSGD with ``levels`` = s: each element is sent as its sign and a level in 0..s, chosen by
    stochastic rounding of ``s * |x| / ||x||_2`` (rounded up with probability equal to the
    fraction), plus the tensor's norm. The estimate ``||x|| * sign * level / s`` is unbiased. A code
    takes ``1 + ceil(log2(s + 1))`` bits (2 for s = 1), packed. Alistarh et al., "QSGD:
    Communication-Efficient SGD via Gradient Quantization and Encoding", NeurIPS 2017."""

    name = "qsgd"
    default_communicator = "allgather"

    def __init__(self, levels: int = 7, seed: int = 0):
        self.levels = check_int("levels", levels, minimum=1)
        self._init_seed(seed)
        self.bits = 1 + math.ceil(math.log2(self.levels + 1))

    def params(self):
        return {"levels": self.levels, "seed": self.seed}

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        # A norm beyond the dtype's range (values near its maximum) is clamped, which keeps the
        # output finite at the price of bias for such tensors only.
        norm = ops.minimum(ops.norm(x), float(np.finfo(ctx.dtype if ctx.dtype != "bfloat16" else
                                                       "float32").max))
        step = self.next_step(name, ops)
        codes = ops.quantize_levels(x, ops.maximum(norm, TINY), self.levels, self.bits,
                                    self._seed_of(name, ctx, shared=False), step)
        return [ops.cast(norm, ctx.dtype), codes]

    def decode(self, payload, ctx, ops):
        norm, packed = payload
        values = level_values(self.bits, ops.scale(ops.cast(norm, compute_dtype(ctx.dtype)),
                                                   1.0 / self.levels), ctx, ops, like=packed)
        return ops.unpack_values(packed, self.bits, ctx.numel, values)

    def payload_nbytes(self, shape, itemsize):
        return itemsize + math.ceil(numel_of(shape) * self.bits / 8)


def level_values(bits: int, unit, ctx, ops, like):
    """The value of every sign-magnitude code ``2 q + negative`` of ``bits`` bits: ``±q * unit``,
    in ``ctx.dtype``; computed once per tensor, the elements are decoded through this table."""
    dtype = compute_dtype(ctx.dtype)
    signed = ops.constant(_signed_levels(bits), dtype, like=like)
    return ops.cast(ops.mul(signed, unit), ctx.dtype)


@lru_cache(maxsize=16)
def _signed_levels(bits: int) -> np.ndarray:
    """``±q`` for each code ``2 q + negative`` (-0.0 for q = 0, negative), exact in any float type."""
    codes = np.arange(1 << bits)
    q = (codes // 2).astype(np.float64)
    return q * np.where(codes % 2 == 1, -1.0, 1.0)
