from __future__ import annotations

import numpy as np

from grace.compressor import TINY, Compressor, compute_dtype, numel_of

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

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        scale = ops.max(ops.abs(x))
        relative = ops.cast(ops.div(ops.abs(x), ops.maximum(scale, TINY)), "float32")
        index = ops.bucketize(relative, ops.constant(BOUNDARIES, "float32", like=flat))
        negative = ops.cast(ops.less(x, 0.0), "int32")
        return [ops.cast(scale, ctx.dtype), ops.cast(ops.add(index, ops.mul(negative, 128)), "uint8")]

    def decode(self, payload, ctx, ops):
        scale, codes = payload
        codes = ops.cast(codes, "int32")
        negative = ops.greater_equal(codes, 128)
        index = ops.where(negative, ops.sub(codes, 128), codes)
        magnitude = ops.gather(ops.constant(TABLE, "float32", like=codes), index)
        value = ops.mul(magnitude, ops.cast(scale, "float32"))
        return ops.cast(ops.where(negative, ops.scale(value, -1.0), value), ctx.dtype)

    def payload_nbytes(self, shape, itemsize):
        return itemsize + numel_of(shape)
