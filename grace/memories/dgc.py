from __future__ import annotations

from grace.compressor import TINY
from grace.memory import Memory
from grace.validation import check_fraction


class DGCMemory(Memory):
    """Deep Gradient Compression's memory. Local gradient clipping rescales the gradient to an L2
    norm of at most ``clip_norm`` (if set); momentum correction accumulates velocity ``u = momentum
    * u + g`` and the residual ``v = v + u``, and ``v`` is what gets compressed; momentum factor
    masking then zeroes ``u`` and ``v`` where entries were sent. Lin et al., ICLR 2018."""

    name = "dgc"

    def __init__(self, momentum: float = 0.9, clip_norm: float | None = None):
        self.momentum = check_fraction("momentum", momentum)
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not clip_norm > 0):
            raise ValueError(f"clip_norm must be a number > 0 or None, got {clip_norm!r}")
        self.clip_norm = clip_norm
        self.velocities: dict = {}
        self.residuals: dict = {}

    def compensate(self, tensor, name, ops):
        if self.clip_norm is not None:
            norm = ops.norm(ops.flatten(tensor))
            factor = ops.minimum(ops.div(ops.full(1, self.clip_norm, ops.dtype(tensor), like=tensor),
                                         ops.maximum(norm, TINY)), 1.0)
            tensor = ops.mul(tensor, ops.reshape(factor, [1] * len(ops.shape(tensor))))
        velocity = ops.load(self.velocities, name, like=tensor)
        velocity = tensor if velocity is None else ops.add(ops.scale(velocity, self.momentum), tensor)
        ops.save(self.velocities, name, velocity)
        residual = ops.load(self.residuals, name, like=tensor)
        return velocity if residual is None else ops.add(residual, velocity)

    def update(self, compensated, name, compressor, payload, ctx, ops):
        sent = compressor.decompress(payload, ctx, ops)
        kept = ops.equal(sent, 0.0)
        zeros = ops.mul(compensated, 0.0)
        ops.save(self.residuals, name, ops.where(kept, compensated, zeros))
        ops.save(self.velocities, name, ops.where(kept, ops.load(self.velocities, name, like=sent), zeros))

    def __repr__(self):
        return f"DGCMemory(momentum={self.momentum}, clip_norm={self.clip_norm})"
