from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from grace import steps
from grace.blocks import DEFAULT_BLOCK_SIZE, Blocks
from grace.compressor import TINY, Compressor, Seeded, Tabled, compute_dtype, numel_of, renamed
from grace.validation import check_int


class QSGD(Seeded, Tabled, Compressor):
    """QSGD with ``levels`` = s, in blocks of ``block_size`` consecutive elements: each element is
    sent as its sign and a level in 0..s, chosen by stochastic rounding of ``s * |x| / ||b||_2``
    (rounded up with probability equal to the fraction), where ``b`` is the element's block, plus
    each block's norm. The estimate ``||b|| * sign * level / s`` is unbiased, with a variance of at
    most ``min(d / s², √d / s) ||x||²`` for blocks of d elements. A code takes
    ``1 + ceil(log2(s + 1))`` bits (2 for s = 1), packed; a norm, one value of the gradient's dtype
    per block. ``block_size=0`` uses one block per tensor. One norm for a whole 400,000-element
    layer makes the estimate ~30x noisier than one per 512 elements (measured: mnist's MLP loses 10
    points of accuracy with one norm per tensor, under 1 with blocks). Alistarh et al., "QSGD:
    Communication-Efficient SGD via Gradient Quantization and Encoding", NeurIPS 2017 (buckets of
    512 in its experiments)."""

    name = "qsgd"
    # Measured by the quality benchmark (docs/quality.md, data/quality/safety.md).
    shortfalls = {
        "words-sgd": "+12.9% perplexity in PyTorch (the mean of three seeds, +12-14%; "
                     "TensorFlow's run matches uncompressed training): at 7 levels its unbiased "
                     "noise, up to about 3 times a "
                     "block's squared norm, slows this model's plain SGD (with the embedding sent "
                     "dense, the same); qsgd(levels=127), 8 bits an element, ends as uncompressed "
                     "training there, qsgd(block_size=128) within its target (+3.7%); from "
                     "Keras's initial weights (an embedding uniform in +-0.05, not a unit normal) "
                     "+0.5% at its defaults (seed 0, against +11.7% from PyTorch's)",
    }
    layout_sensitive = True  # blocks of consecutive elements
    default_communicator = "allgather"

    def __init__(self, levels: int = 7, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0,
                 bucket_size: int | None = None):
        self.levels = check_int("levels", levels, minimum=1)
        block_size = renamed("block_size", block_size, bucket_size, DEFAULT_BLOCK_SIZE)
        self.block_size = check_int("block_size", block_size, minimum=0)
        self._init_seed(seed)
        self.bits = 1 + math.ceil(math.log2(self.levels + 1))

    def params(self):
        return {"levels": self.levels, "block_size": self.block_size, "seed": self.seed}

    def blocks(self, numel: int) -> Blocks:
        return Blocks.of(numel, self.block_size)

    def compress_flat(self, flat, name, ctx, ops):
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        blocks = self.blocks(ctx.numel)
        # A norm beyond the dtype's range (values near its maximum) is clamped, which keeps the
        # output finite at the price of bias for such tensors only.
        largest = float(np.finfo(ctx.dtype if ctx.dtype != "bfloat16" else "float32").max)
        squares = steps.block_parts(blocks, x, ops)[3]
        norms = ops.minimum(ops.cast(ops.sqrt(squares), ops.dtype(x)), largest)
        codes = steps.quantize_levels(
            ops, x, ops.maximum(norms, TINY), levels=self.levels, bits=self.bits, block=blocks.size,
            seed=(self._seed_of(name, ctx, shared=False), self.next_step(name, ops)))
        return [ops.cast(norms, ctx.dtype), codes]

    def tables(self, payload, ctx, ops):
        norms, packed = payload
        dtype = compute_dtype(ctx.dtype)
        blocks = self.blocks(ctx.numel)
        # Each block's 2^bits values, ±q * norm / s: the elements are decoded through them.
        units = blocks.column(ops.scale(ops.cast(norms, dtype), 1.0 / self.levels), ops)
        signed = ops.reshape(ops.constant(_signed_levels(self.bits), dtype, like=packed), (1, -1))
        return packed, self.bits, ops.cast(ops.mul(units, signed), ctx.dtype), blocks.size

    def payload_nbytes(self, shape, itemsize):
        numel = numel_of(shape)
        return self.blocks(numel).count * itemsize + math.ceil(numel * self.bits / 8)


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
