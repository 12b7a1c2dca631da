"""Blocks: a flat tensor cut into rows of ``size`` consecutive elements (the last one padded with
zeros), so that a quantizer can keep one scale per block instead of one per tensor. QSGD's paper
quantizes in buckets of 512 (Alistarh et al., NeurIPS 2017), 1-bit SGD per column (Seide et al.,
Interspeech 2014), and blockwise scaled signs keep error-feedback signSGD close to SGD (Zheng et al.,
"Communication-Efficient Distributed Blockwise Momentum SGD with Error-Feedback", NeurIPS 2019): a
scale per 512 elements costs 1/16 of a bit per element and follows the gradient's magnitude across
a layer, which one scale per tensor cannot."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 512


@dataclass(frozen=True)
class Blocks:
    """The layout of a tensor of ``numel`` elements in blocks of ``size`` (``count`` of them)."""

    numel: int
    count: int
    size: int

    @classmethod
    def of(cls, numel: int, block_size: int) -> "Blocks":
        """``block_size=0``, or one at least as large as the tensor: one block."""
        size = numel if block_size == 0 or block_size >= numel else block_size
        size = max(size, 1)
        return cls(numel, -(-numel // size), size)

    @property
    def pad(self) -> int:
        return self.count * self.size - self.numel

    def rows(self, x, ops):
        """The 1-d ``x`` as ``count`` rows of ``size``, the last one padded with zeros."""
        if self.pad:
            x = ops.concat([x, ops.zeros(self.pad, ops.dtype(x), like=x)])
        return ops.reshape(x, (self.count, self.size))

    def flat(self, rows, ops):
        """The first ``numel`` elements of ``rows``, as a 1-d tensor."""
        flat = ops.flatten(rows)
        return ops.split(flat, [self.numel, self.pad])[0] if self.pad else flat

    def lengths(self, dtype: str, ops, like):
        """How many of each row's elements are the tensor's (``size``, the last one fewer), as a
        1-d tensor of ``dtype``."""
        last = self.numel - (self.count - 1) * self.size
        return ops.constant([float(self.size)] * (self.count - 1) + [float(last)], dtype, like=like)

    def column(self, per_block, ops):
        """A 1-d tensor of one value per block as a column, to scale the rows by broadcasting."""
        return ops.reshape(per_block, (self.count, 1))
