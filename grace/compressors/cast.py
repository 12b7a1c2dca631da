from __future__ import annotations

from grace.compressor import Compressor


class FP16(Compressor):
    """Half precision: each element is cast to IEEE float16 for the wire and back on arrival, halving
    the bytes of a float32 gradient. Values beyond float16's range (65504) overflow to infinity, as
    with Horovod's ``Compression.fp16``; tensors already 16-bit travel unchanged. Payloads of all workers
    share one layout, so they are summed by allreduce. See Micikevicius et al., "Mixed Precision
    Training", ICLR 2018."""

    name = "fp16"
    summable = True
    wire_dtype = "float16"

    def encode(self, flat, name, ctx, ops):
        if ctx.dtype in ("float32", "float64"):
            return [ops.cast(flat, self.wire_dtype)]
        return [flat]

    def decode(self, payload, ctx, ops):
        return ops.cast(payload[0], ctx.dtype)

    def payload_nbytes(self, numel, itemsize):
        return numel * min(itemsize, 2)
