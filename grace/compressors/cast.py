from __future__ import annotations

from grace.compressor import DEFAULT_MIN_NUMEL, Compressor, numel_of


class FP16(Compressor):
    """Half precision: each element is cast to IEEE float16 for the wire and back on arrival, halving
    the bytes of a float32 gradient. Values beyond float16's range (65504) overflow to infinity, as
    with Horovod's ``Compression.fp16``; tensors already 16-bit travel unchanged. Payloads of all workers
    share one layout, so they are summed by allreduce. See Micikevicius et al., "Mixed Precision
    Training", ICLR 2018."""

    name = "fp16"
    summable = True
    wire_dtype = "float16"
    elementwise = True
    keeps_nonfinite = True  # Inf and NaN cast to Inf and NaN; an overflow becomes Inf
    decodes_by_cast = True
    # Every float tensor cast, as Horovod's Compression.fp16 and PyTorch's fp16_compress_hook do:
    # joined with its bucket (Pipeline._joins_alike) a small one costs no collective of its own,
    # and a DDP bucket's tensors, all cast, are one view of its buffer, decoded back into it.
    default_min_numel = 0

    def compress_flat(self, flat, name, ctx, ops):
        if ctx.dtype in ("float32", "float64"):
            return [ops.cast(flat, self.wire_dtype)]
        return [flat]

    def decompress_flat(self, payload, ctx, ops):
        return ops.cast(payload[0], ctx.dtype)

    def payload_nbytes(self, shape, itemsize):
        return numel_of(shape) * min(itemsize, 2)


class BF16(FP16):
    """bfloat16: each element is cast to bfloat16 for the wire (float32's 8-bit exponent, 7-bit
    mantissa), so nothing overflows that float32 can hold; precision drops to about 3 significant
    digits. Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", 2019.

    Horovod 0.28.1 cannot reduce bfloat16 tensors, so the payloads are gathered (carried bit for bit)
    and summed after decompression: bytes per worker grow with the number of workers, unlike
    ``fp16``. The numpy reference backend has no bfloat16: use torch or TensorFlow tensors."""

    name = "bf16"
    wire_dtype = "bfloat16"
    summable = False
    default_communicator = "allgather"
    # Gathered, each tensor is a payload of its own to pack and unpack: the small ones are summed
    # dense, joined, instead.
    default_min_numel = DEFAULT_MIN_NUMEL
