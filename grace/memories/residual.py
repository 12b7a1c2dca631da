from __future__ import annotations

from grace.memory import Memory


class ResidualMemory(Memory):
    """Error feedback: before compressing, add to the gradient the residual that earlier steps did not
    send; after compressing, keep as the new residual what this payload leaves out,
    ``residual = (gradient + residual) - decompress(compress(gradient + residual))``. Nothing is lost,
    only delayed. Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Karimireddy et
    al., "Error Feedback Fixes SignSGD", ICML 2019."""

    name = "residual"

    def __init__(self):
        self.residuals: dict = {}

    def compensate(self, tensor, name, ops):
        residual = ops.load(self.residuals, name, like=tensor)
        return tensor if residual is None else ops.add(tensor, residual)

    def update(self, compensated, name, compressor, payload, ctx, ops):
        ops.save(self.residuals, name, compressor.residual(compensated, payload, ctx, ops))


class EFSignSGDMemory(ResidualMemory):
    """Error feedback as EF-signSGD states it, ``p = g + e``, ``e = p - C(p)``, with the learning
    rate left to the optimizer (constant rates fold into ``e``). Karimireddy et al., ICML 2019."""

    name = "efsignsgd"


class PowerSGDMemory(ResidualMemory):
    """PowerSGD's error feedback: the part of ``M + e`` that this worker's rank-r approximation
    ``P Q_localᵀ`` leaves out is added to the next step's gradient. Vogels et al., NeurIPS 2019."""

    name = "powersgd"
