"""Two-bit quantization with error feedback (MXNet's ``2bit``, Strom 2015): ``TwoBit``."""

from __future__ import annotations

import math

import numpy as np

from grace import native
from grace.blocks import DEFAULT_BLOCK_SIZE, Blocks
from grace.compressor import Compressor, Tabled, compute_dtype, numel_of, renamed
from grace.kernels import accelerated
from grace.validation import check_bool, check_int, check_positive

# The largest finite float16: a larger t is sent as this, and error feedback keeps the rest.
FLOAT16_MAX = 65504.0


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
    default threshold (docs/quality.md, "Two-bit quantization"). By default ``threshold`` is a
    multiple of the root mean square of each block of ``block_size`` (512) consecutive elements
    of the compensated tensor (``relative=True``; each block's ``t`` is sent, 1/16 of a bit an
    element), so that one setting fits gradients of any size and follows their scale across a
    layer, as 1-bit SGD's per-column means do; ``block_size=0`` takes one ``t`` for the whole
    tensor, which misses uncompressed accuracy on mnist by 1.1 points over three seeds where
    blocks of 512 stay within 0.5. ``relative=False`` takes ``threshold`` as MXNet does, an
    absolute value for every element (MXNet's default is 0.5), under which small gradients send
    nothing for many steps and then leave in bursts. The defaults are measured (docs/quality.md,
    "Two-bit quantization"). Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing", Interspeech 2015; Apache MXNet, "Gradient Compression" (``kvstore``)."""

    name = "twobit"
    default_memory = "momentum"  # error feedback on the velocity, SGD's momentum taken over
    default_communicator = "allgather"
    # Measured by the quality benchmark (docs/quality.md, data/quality/safety.md).
    shortfalls = {
        "lstm-sgd": "+4.2% perplexity (TensorFlow; PyTorch +0.7%) at 4,000 steps, +4.4% at 8,000: "
                    "from Keras's initial weights, not the framework (PyTorch's LSTM started from "
                    "Keras's weights loses +5.1%), where error feedback's delayed steps cost more; "
                    "no threshold or block size tried (0.5, 0.7, blocks of 32 or 64) ends within 2%; "
                    "topk and powersgd end within 2% there in both frameworks",
    }
    # Measured (scripts/studies/simulate_mnist.py, 4 workers, one pass, seeds 0-2, docs/quality.md "Two-bit
    # quantization"): 7.7 to 16.1 points below gathering, where 1-bit SGD loses 2.1.
    owners_caution = ("an owner's second two-bit encoding holds most of its shard's sum back in its "
                      "residual, behind the workers' own: a second delay that costs accuracy")

    def __init__(self, threshold: float = 1.0, relative: bool = True, block_size: int | None = None,
                 bucket_size: int | None = None):
        self.threshold = check_positive("threshold", threshold)
        self.relative = check_bool("relative", relative)
        block_size = renamed("block_size", block_size, bucket_size, None)
        if block_size is None:  # an absolute threshold is one t for every element
            block_size = DEFAULT_BLOCK_SIZE if self.relative else 0
        self.block_size = check_int("block_size", block_size, minimum=0)
        if self.block_size and not self.relative:
            raise ValueError(f"block_size={self.block_size} needs relative=True: an absolute threshold "
                             "is one t for every element; leave block_size out with relative=False")
        self.layout_sensitive = self.block_size > 0  # blocks of consecutive elements: their order counts

    def params(self):
        # An absolute threshold has no blocks: MXNet's reads (and checkpoints) as it always has.
        return {"threshold": self.threshold, "relative": self.relative} | (
            {"block_size": self.block_size} if self.relative else {})

    def blocks(self, numel: int) -> Blocks:
        """The blocks of a tensor of ``numel`` elements that share one ``t``."""
        return Blocks.of(numel, self.block_size)

    def _thresholds(self, rows, blocks, ctx, ops):
        """Each block's ``t``, as a 1-d tensor of ``rows``' dtype."""
        if not self.relative:
            return ops.constant([self.threshold], ops.dtype(rows), like=rows)
        # threshold / sqrt(length) from Python floats, so that one block gives t exactly as
        # threshold x the tensor's root mean square in float32 (tests/reference.py); a ragged last
        # block's over its own elements. No per-block constant: it would be made every step.
        norms = ops.row_norms(rows)
        last = ctx.numel - (blocks.count - 1) * blocks.size
        if last == blocks.size or blocks.count == 1:
            return ops.scale(norms, self.threshold / math.sqrt(max(last, 1)))
        head, tail = ops.split(norms, [blocks.count - 1, 1])
        return ops.concat([ops.scale(head, self.threshold / math.sqrt(blocks.size)),
                           ops.scale(tail, self.threshold / math.sqrt(last))])

    def compress_flat(self, flat, name, ctx, ops):
        blocks = self.blocks(ctx.numel)
        rows = blocks.rows(ops.cast(flat, compute_dtype(ctx.dtype)), ops)
        t = self._thresholds(rows, blocks, ctx, ops)
        # The rows padded once, for the thresholds and the codes alike (their first numel elements
        # are the tensor's: the C loop reads those; the composite step takes the rows as they are).
        packed = codes(ops, ops.flatten(rows), t, n=ctx.numel, block=blocks.size)
        if ctx.dtype == "float16":  # a t beyond float16's range would decode 0 x inf = NaN
            t = ops.minimum(t, FLOAT16_MAX)
        return [ops.cast(t, ctx.dtype), packed] if self.relative else [packed]

    def tables(self, payload, ctx, ops):
        blocks = self.blocks(ctx.numel)
        if self.relative:
            t, packed = payload
        else:
            (packed,) = payload
            t = ops.constant([self.threshold], ctx.dtype, like=packed)
        signs = ops.constant([0.0, 0.0, -1.0, 1.0], ctx.dtype, like=packed)  # codes 00, 01, 10, 11
        tables = ops.mul(blocks.column(ops.cast(t, ctx.dtype), ops), ops.reshape(signs, (1, 4)))
        return packed, 2, tables, blocks.size

    def payload_nbytes(self, shape, itemsize):
        thresholds = self.blocks(numel_of(shape)).count if self.relative else 0
        return math.ceil(numel_of(shape) * 2 / 8) + thresholds * itemsize


# The loop of twobit.c beside this file: the codes of every element, packed, in one pass.
CODES_LOOP = native.Loop("grace_twobit_codes", (native.In(0), native.START, native.COUNT, native.In(1),
                                                native.Param("block", native.I64), native.Out(0)))


def _codes_loop(x: np.ndarray, thresholds: np.ndarray, n: int, block: int) -> np.ndarray:
    if block < 1 or thresholds.size != -(-n // block):  # the C loop would read past them
        raise ValueError(f"two-bit's codes: {thresholds.size} thresholds for {n} elements in "
                         f"blocks of {block}")
    out = native.empty((n * 2 + 7) // 8, np.uint8)
    native.run(CODES_LOOP, n, [x, thresholds], [out], {"block": block})
    return out


native.register("twobit_codes", native.Kernel(
    _codes_loop, lambda x, thresholds, n, block: [("uint8", ((n * 2 + 7) // 8,))],
    native.float32_at(0, 1)))


@accelerated("twobit_codes")
def codes(ops, x, thresholds, *, n, block):
    """The packed codes of the 1-d ``x`` (its first ``n`` elements), each against the threshold
    ``t`` of its block of ``block`` elements (``thresholds``, one per block): 3 (``11``) at or
    above ``t``, 2 (``10``) at or below ``-t`` where ``x < 0``, else 0, four to a byte. ``x`` may
    already be padded to whole blocks (``Blocks.rows``, flattened), as ``compress_flat`` gives it."""
    blocks = Blocks.of(n, block)
    padded = ops.numel(x) == blocks.count * blocks.size
    rows = ops.reshape(x, (blocks.count, blocks.size)) if padded else blocks.rows(x, ops)
    column = blocks.column(thresholds, ops)  # an absolute threshold's one block: one t for every row
    dtype = ops.dtype(rows)
    up = ops.cast(ops.greater_equal(rows, column), dtype)  # 3 (11) at or above t
    # 2 (10) at or below -t; below 0 too, so that t = 0 (an all-zero block) codes 0 as 11 only.
    # The padding's zeros code 00 (or 11 where t = 0): both decode to 0, and are not sent.
    down = ops.mul(ops.cast(ops.greater_equal(ops.scale(rows, -1.0), column), dtype),
                   ops.cast(ops.less(rows, 0.0), dtype))
    found = blocks.flat(ops.add(ops.scale(up, 3.0), ops.scale(down, 2.0)), ops)
    return ops.pack_bits(ops.cast(found, "int32"), 2)
