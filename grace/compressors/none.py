from __future__ import annotations

from grace.compressor import Compressor, numel_of


class NoneCompressor(Compressor):
    """No compression: the gradient travels as it is. The baseline every compressor is measured
    against, and what tensors too small to compress fall back to."""

    name = "none"
    summable = True
    elementwise = True
    keeps_nonfinite = True
    decodes_by_cast = True

    def compress_flat(self, flat, name, ctx, ops):
        return [flat]

    def decompress_flat(self, payload, ctx, ops):
        return payload[0]

    def payload_nbytes(self, shape, itemsize):
        return numel_of(shape) * itemsize
