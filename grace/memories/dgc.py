from __future__ import annotations

from grace.compressor import TINY
from grace.memories.momentum import MomentumMemory


class DGCMemory(MomentumMemory):
    """Deep Gradient Compression's memory. Local gradient clipping rescales the gradient to an L2
    norm of at most ``clip_norm`` (if set); momentum correction accumulates the velocity ``u =
    momentum * u + g`` and the residual ``v = v + u``, and ``v`` is what gets compressed; momentum
    factor masking then zeroes ``u`` and ``v`` where entries were sent. The momentum is the wrapped
    optimizer's, taken over so that it applies once (``grace.momentum``): none over an optimizer
    without momentum (plain error feedback then), and the paper's 0.9 where no optimizer is seen
    (``DistributedGradientTape``).
    Lin et al., ICLR 2018."""

    name = "dgc"
    default_momentum = 0.9
    takes_adam_beta1 = True

    def __init__(self, momentum: float | None = None, clip_norm: float | None = None,
                 nesterov: bool = False, dampening: float = 0.0):
        super().__init__(momentum, nesterov, dampening)
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not clip_norm > 0):
            raise ValueError(f"clip_norm must be a number > 0 or None, got {clip_norm!r}")
        self.clip_norm = clip_norm

    def compensate(self, tensor, name, ops, overwrite=False):
        if self.clip_norm is not None:
            norm = ops.norm(ops.flatten(tensor))
            factor = ops.minimum(ops.div(ops.full(1, self.clip_norm, ops.dtype(tensor), like=tensor),
                                         ops.maximum(norm, TINY)), 1.0)
            tensor = ops.mul(tensor, ops.reshape(factor, [1] * len(ops.shape(tensor))))
            overwrite = True  # a tensor of its own now
        return super().compensate(tensor, name, ops, overwrite)

    def update(self, compensated, name, compressor, payload, ctx, ops):
        # Masking: the residual and the velocity zeroed where entries were sent, each in one copy;
        # for a payload other than entries as they are, where the decompressed tensor is not 0.
        indices = compressor.sent_indices(payload, ctx)
        if indices is None:
            sent = ops.abs(ops.flatten(compressor.decompress(payload, ctx, ops)))
            indices = ops.nonzero(ops.less(ops.scale(sent, -1.0), 0.0))  # sent != 0
        residual = compressor.residual(compensated, payload, ctx, ops, overwrite=True)
        self.state_store.save(ops, self.residuals, name, residual)
        if self.momentum != 0.0:
            velocity = ops.flatten(self.state_store.load(ops, self.velocities, name, like=compensated))
            self.state_store.save(ops, self.velocities, name,
                                  ops.reshape(ops.zero_at(velocity, indices), ctx.shape))

    def __repr__(self):
        params = {**self.momentum_params(), "clip_norm": self.clip_norm}
        return f"DGCMemory({', '.join(f'{k}={v!r}' for k, v in params.items())})"
