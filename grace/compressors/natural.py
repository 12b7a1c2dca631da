from __future__ import annotations

import math

import numpy as np

from grace import native
from grace.compressor import Compressor, Seeded, numel_of
from grace.kernels import accelerated


class Natural(Seeded, Compressor):
    """Natural compression: each element is rounded at random to one of the two powers of two around
    it, ``2^e <= |x| < 2^(e+1)``, up with probability ``(|x| - 2^e) / 2^e``, which is unbiased and
    within a factor of 2 of ``|x|``. Sent: the sign (1 bit, packed) and the float32 exponent field
    (8 bits; 0 stands for zero), 9 bits per element. Elements below the smallest normal float32 round
    to 0 or to it. Horváth et al., "Natural Compression for Distributed Deep Learning", 2019."""

    name = "natural"
    default_communicator = "allgather"

    def __init__(self, seed: int = 0):
        self._init_seed(seed)

    def compress_flat(self, flat, name, ctx, ops):
        x = ops.cast(flat, "float32")
        step = self.next_step(name, ops)
        return list(encode(ops, x, seed=(self._seed_of(name, ctx, shared=False), step)))

    def decompress_flat(self, payload, ctx, ops):
        return ops.cast(decode(ops, *payload), ctx.dtype)

    def payload_nbytes(self, shape, itemsize):
        n = numel_of(shape)
        return n + math.ceil(n / 8)


# The loops of natural.c beside this file: the encoding in one pass, and its inverse.
ENCODE_LOOP = native.Loop("grace_natural_encode", (native.In(0), native.START, native.COUNT, *native.KEY,
                                                   native.Out(0), native.Out(1)))
DECODE_LOOP = native.Loop("grace_natural_decode", (native.In(0), native.In(1), native.START, native.COUNT,
                                                   native.Out(0)))


def _encode_loop(x: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    codes, signs = native.empty(x.size, np.uint8), native.empty((x.size + 7) // 8, np.uint8)
    native.run(ENCODE_LOOP, x.size, [x], [codes, signs], seed=seed)
    return codes, signs


def _decode_loop(codes: np.ndarray, signs: np.ndarray) -> np.ndarray:
    out = native.empty(codes.size, np.float32)
    native.run(DECODE_LOOP, codes.size, [codes, signs], [out])
    return out


native.register("natural_encode", native.Kernel(
    _encode_loop, lambda x: [("uint8", x), ("uint8", ((x[0] + 7) // 8,))], native.float32_at(0)))
native.register("natural_decode", native.Kernel(_decode_loop, lambda codes, signs: [("float32", codes)]))


@accelerated("natural_encode")
def encode(ops, x, seed):
    """The exponent codes (uint8) and the packed signs of float32 ``x``, rounding up at random by
    ``Ops.random_uniform`` with ``seed`` = ``(seed_of, step)``."""
    n = ops.numel(x)
    magnitude = ops.abs(x)
    exponent = ops.exponent_bits(magnitude)
    normal = ops.greater_equal(exponent, 1)
    low = ops.power_of_two(ops.maximum(exponent, 1))  # 2^e, or the smallest normal float32
    excess = ops.where(normal, ops.sub(magnitude, low), magnitude)
    uniform = ops.random_uniform(n, seed[0], seed[1], like=x)
    up = ops.cast(ops.less(uniform, ops.div(excess, low)), "int32")
    code = ops.where(normal, ops.add(exponent, up), up)
    code = ops.minimum(code, 254)  # the largest finite exponent
    negative = ops.cast(ops.less(x, 0.0), "int32")
    return ops.cast(code, "uint8"), ops.pack_bits(negative, 1)


@accelerated("natural_decode")
def decode(ops, code, packed):
    """The float32 values of the exponent codes and packed signs."""
    n = ops.numel(code)
    code = ops.cast(code, "int32")
    magnitude = ops.where(ops.equal(code, 0), ops.zeros(n, "float32", like=code),
                          ops.power_of_two(ops.maximum(code, 1)))
    negative = ops.cast(ops.unpack_bits(packed, 1, n), "float32")
    sign = ops.sub(ops.full(n, 1.0, "float32", like=code), ops.scale(negative, 2.0))
    return ops.mul(magnitude, sign)
