"""Two-bit quantization with error feedback (MXNet's ``2bit``, Strom 2015): ``TwoBit``."""

from __future__ import annotations

import math

from grace.compressor import Compressor, Tabled, compute_dtype, numel_of
from grace.validation import check_bool, check_positive


class TwoBit(Tabled, Compressor):
    """Two-bit quantization with error feedback, as MXNet's gradient compression ships it (``'type':
    '2bit'``): each element of the compensated gradient (the gradient plus the residual error
    feedback kept) becomes ``+t`` at or above the threshold ``t`` (code ``11``), ``-t`` at or below
    ``-t`` (``10``), and 0 otherwise (``00``); 2 bits an element, packed four to a byte (the density
    of MXNet's sixteen to a 32-bit word), and the quantization error stays in the residual, so that
    an element below the threshold is sent once its residual reaches it. This is Strom's threshold
    quantization with error feedback at two bits. As for 1-bit SGD, the error feedback is on the
    velocity: the wrapped optimizer's momentum is taken over (the ``momentum`` memory), since the
    optimizer's momentum acting on error feedback's delayed updates cost 6.7 points on mnist at the
    default threshold (docs/quality.md, "Two-bit quantization"). ``threshold`` is a multiple of the
    compensated tensor's root mean square by default (``relative=True``; that ``t`` is sent, one
    value per tensor), so that one setting fits gradients of any size; ``relative=False`` takes it
    as MXNet does, an absolute value (MXNet's default is 0.5), under which small gradients send
    nothing for many steps and then leave in bursts. The defaults are measured (docs/quality.md,
    "Two-bit quantization"). Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing", Interspeech 2015; Apache MXNet, "Gradient Compression" (``kvstore``)."""

    name = "twobit"
    default_memory = "momentum"  # error feedback on the velocity, SGD's momentum taken over
    default_communicator = "allgather"

    def __init__(self, threshold: float = 1.0, relative: bool = True):
        self.threshold = check_positive("threshold", threshold)
        self.relative = check_bool("relative", relative)

    def params(self):
        return {"threshold": self.threshold, "relative": self.relative}

    def _threshold(self, x, ctx, ops):
        if not self.relative:
            return ops.constant([self.threshold], compute_dtype(ctx.dtype), like=x)
        return ops.scale(ops.norm(x), self.threshold / math.sqrt(max(ctx.numel, 1)))

    def encode(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        t = self._threshold(x, ctx, ops)
        dtype = ops.dtype(x)
        up = ops.cast(ops.greater_equal(x, t), dtype)  # 3 (11) at or above t
        # 2 (10) at or below -t; below 0 too, so that t = 0 (an all-zero tensor) codes 0 as 11 only
        down = ops.mul(ops.cast(ops.greater_equal(ops.scale(x, -1.0), t), dtype),
                       ops.cast(ops.less(x, 0.0), dtype))
        codes = ops.add(ops.scale(up, 3.0), ops.scale(down, 2.0))
        packed = ops.pack_bits(ops.cast(codes, "int32"), 2)
        return [ops.cast(t, ctx.dtype), packed] if self.relative else [packed]

    def tables(self, payload, ctx, ops):
        if self.relative:
            t, packed = payload
        else:
            (packed,) = payload
            t = ops.constant([self.threshold], ctx.dtype, like=packed)
        signs = ops.constant([0.0, 0.0, -1.0, 1.0], ctx.dtype, like=packed)  # codes 00, 01, 10, 11
        return packed, 2, ops.reshape(ops.mul(signs, ops.cast(t, ctx.dtype)), (1, 4)), max(ctx.numel, 1)

    def payload_nbytes(self, shape, itemsize):
        return math.ceil(numel_of(shape) * 2 / 8) + (itemsize if self.relative else 0)
