from __future__ import annotations

import numpy as np

from grace import native, steps
from grace.compressor import TINY, Compressor, compute_dtype, numel_of
from grace.kernels import accelerated

# 128 magnitudes: 0 and 2^((i - 127) / 8) for i = 1..127, i.e. from 2^-15.75 to 1, 1/8 octave apart.
TABLE = np.concatenate([[0.0], np.exp2((np.arange(1, 128) - 127) / 8.0)]).astype(np.float32)
# An element goes to the nearest magnitude in the log domain: the boundaries are geometric means of
# neighbours (and half the smallest magnitude, below which it becomes 0).
BOUNDARIES = np.concatenate([[TABLE[1] / 2], np.sqrt(TABLE[1:-1] * TABLE[2:])]).astype(np.float32)


class U8bit(Compressor):
    """8-bit approximation: each element, divided by the tensor's largest magnitude (sent once), is
    replaced by the nearest of 128 fixed magnitudes spaced 1/8 octave apart, from 2^-15.75 to 1, or
    by 0, and sent as one byte: the sign bit and the 7-bit index into that table. The relative error
    of an element is at most 2^(1/16) - 1 (4.4%) above the smallest magnitude. Dettmers, "8-Bit
    Approximations for Parallelism in Deep Learning", ICLR 2016 (a fixed logarithmic table in place
    of its dynamic data type)."""

    name = "u8bit"
    default_communicator = "allgather"

    def compress_flat(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        scale = ops.max_abs(x)
        divisor = ops.maximum(scale, TINY)
        boundaries = ops.constant(BOUNDARIES, "float32", like=flat)
        return [ops.cast(scale, ctx.dtype), magnitude_bins(ops, x, divisor, boundaries)]

    def decompress_flat(self, payload, ctx, ops):
        scale, codes = payload
        # The 256 possible bytes' values, computed once; the elements are decoded through them.
        value = ops.mul(ops.constant(TABLE, "float32", like=codes), ops.cast(scale, "float32"))
        table = ops.cast(ops.concat([value, ops.scale(value, -1.0)]), ctx.dtype)
        return steps.unpack_values(ops, codes, table, bits=8, n=ctx.numel)

    def payload_nbytes(self, shape, itemsize):
        return itemsize + numel_of(shape)


# The loop of u8bit.c beside this file: each element's bin and sign in one pass.
BINS_LOOP = native.Loop("grace_magnitude_bins", (
    native.In(0), native.START, native.COUNT, native.Param("divisor"), native.In(1), native.In(2),
    native.In(3), native.Param("shift", native.INT), native.Out(0)))


def _bins_loop(x: np.ndarray, divisor: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """For float32 ``x``: how many ``boundaries`` are <= ``|x| / divisor``, plus 128 where x < 0."""
    table, low, high, shift = native.bin_index(boundaries)
    out = native.empty(x.size, np.uint8)
    native.run(BINS_LOOP, x.size, [x, table, low, high], [out],
               {"divisor": native.scalar(divisor), "shift": shift})
    return out


native.register("magnitude_bins", native.Kernel(
    _bins_loop, lambda x, divisor, boundaries: [("uint8", x)], native.float32_at(0, 1, 2)))


@accelerated("magnitude_bins")
def magnitude_bins(ops, x, divisor, boundaries):
    """Each element's code: how many ``boundaries`` are ``<= |x| / divisor``, plus 128 where
    ``x < 0`` (uint8)."""
    relative = ops.cast(ops.div(ops.abs(x), divisor), "float32")
    index = ops.bucketize(relative, boundaries)
    negative = ops.cast(ops.less(x, 0.0), "int32")
    return ops.cast(ops.add(index, ops.mul(negative, 128)), "uint8")
