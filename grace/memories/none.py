from __future__ import annotations

from grace.memory import Memory


class NoneMemory(Memory):
    """No memory: what a compressor drops is lost. Right for unbiased compressors (QSGD, TernGrad)
    and for those that lose nothing (none, fp16)."""

    name = "none"
    stateless = True

    def compensate(self, tensor, name, ops, overwrite=False):
        return tensor

    def update(self, compensated, name, compressor, payload, ctx, ops):
        pass
