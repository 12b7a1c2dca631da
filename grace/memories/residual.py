from __future__ import annotations

from grace.memory import Memory
from grace.momentum import OptimizerMomentum, OwnsMomentum


class ResidualMemory(Memory):
    """Error feedback: before compressing, add to the gradient the residual that earlier steps did not
    send; after compressing, keep as the new residual what this payload leaves out,
    ``residual = (gradient + residual) - decompress(compress(gradient + residual))``. Nothing is lost,
    only delayed. Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Karimireddy et
    al., "Error Feedback Fixes SignSGD", ICML 2019."""

    name = "residual"

    def __init__(self):
        self.residuals: dict = {}

    def compensate(self, tensor, name, ops, overwrite=False):
        residual = self.state_store.load(ops, self.residuals, name, like=tensor)
        # A tensor of its own either way, which ``update`` may turn into the residual in place:
        # with ``overwrite``, the gradient's own (no full-size tensor made per step).
        if residual is None:
            return tensor if overwrite and ops.writable(tensor) else ops.copy(tensor)
        return ops.add_into(tensor, residual) if overwrite else ops.add(tensor, residual)

    def update(self, compensated, name, compressor, payload, ctx, ops):
        residual = compressor.residual(compensated, payload, ctx, ops, overwrite=True)
        self.state_store.save(ops, self.residuals, name, residual)


class PowerSGDMemory(ResidualMemory):
    """PowerSGD's error feedback: the part of ``M + e`` that this worker's rank-r approximation
    ``P Q_localᵀ`` leaves out is added to the next step's gradient. Vogels et al., NeurIPS 2019."""

    name = "powersgd"


class DelayedResidualMemory(OwnsMomentum, ResidualMemory):
    """Error feedback for a sparsifier that picks its entries at random (random-k): an element is
    sent only about every ``1 / ratio`` steps, with all it accumulated meanwhile. Momentum on such
    delayed updates, whether the optimizer's after the exchange or a velocity compressed before it,
    multiplies each burst by ``1 / (1 - momentum)`` and diverges (measured: mnist's MLP, random-k
    1%, momentum 0.9, from the first epoch; momentum 0 trains to within a point of uncompressed
    momentum SGD, docs/quality.md). So the wrapped optimizer's momentum is taken over and not
    applied; the learning rate is left as it is. Wrapping Adam, each gradient is also folded into
    the worker's own second moment (``moments``, ``grace.second_moment``) before error feedback adds
    the residual. Stich et al., "Sparsified SGD with Memory", NeurIPS 2018 (its analysis is of plain
    SGD)."""

    name = "delayed"
    observes_second_moment = True
    moments = None
    """Adam's second moment (``grace.second_moment.SharedSecondMoment``), when taken over."""

    def __init__(self):
        super().__init__()
        self._init_momentum(None)
        self.turned_off = 0.0

    def compensate(self, tensor, name, ops, overwrite=False):
        if self.moments is not None:
            self.moments.observe(tensor, name, ops)
        return super().compensate(tensor, name, ops, overwrite)

    def take_momentum(self, found: OptimizerMomentum) -> None:
        self.turned_off = found.momentum  # self.momentum stays 0

    def takeover_line(self, found: OptimizerMomentum, compressor: str) -> str:
        return (f"grace: {compressor} turns {found.source} ({found.momentum}) off on the tensors "
                f"it compresses: its error feedback delays each element about 1/ratio steps, and "
                f"momentum on those delayed updates diverges (docs/quality.md); the tensors sent "
                f"dense (under min_numel) keep it, applied before the exchange; the learning rate "
                f"is unchanged; grace.{compressor}(keep_optimizer=True) leaves the momentum on")

    def unseen_optimizer_line(self, compressor: str, wrapper: str = "DistributedGradientTape"
                              ) -> str | None:
        return (f"grace: {compressor}'s error feedback delays each element about 1/ratio steps, "
                f"and an optimizer's momentum on those delayed updates diverges "
                f"(docs/quality.md): {wrapper} sees no optimizer to turn it off, so "
                f"give the optimizer no momentum")

    def __repr__(self):
        return f"DelayedResidualMemory(turned_off={self.turned_off!r})"
