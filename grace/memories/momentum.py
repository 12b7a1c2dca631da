from __future__ import annotations

from grace import steps
from grace.memories.residual import ResidualMemory
from grace.momentum import OwnsMomentum


class MomentumMemory(OwnsMomentum, ResidualMemory):
    """Error feedback on the velocity: the worker keeps its momentum ``u = momentum * u + (1 -
    dampening) * g`` and compresses ``e + u`` (``e + g + momentum * u`` with Nesterov), keeping
    ``e = (e + u) - decompress(compress(e + u))``; the optimizer then steps without momentum. Summed
    over steps, what is sent equals the momentum SGD update, but delayed residuals no longer pass
    through a second momentum, which makes 1-bit SGD and EF-signSGD diverge on the user's momentum
    SGD. The momentum is the wrapped optimizer's, taken over (``grace.momentum``); with none, this is
    the ``residual`` memory exactly. Lin et al., "Deep Gradient Compression", ICLR 2018 (momentum
    correction); Tang et al., "1-bit Adam", ICML 2021 (compressing the momentum with error
    compensation)."""

    name = "momentum"

    def __init__(self, momentum: float | None = None, nesterov: bool = False, dampening: float = 0.0):
        super().__init__()
        self._init_momentum(momentum, nesterov, dampening)
        self.velocities: dict = {}

    def velocity_step(self, tensor, name, ops):
        """What momentum SGD would step by this time (and the velocity, saved)."""
        if self.momentum == 0.0:
            return tensor if self.dampening == 0.0 else ops.scale(tensor, 1.0 - self.dampening)
        velocity = self.state_store.load(ops, self.velocities, name, like=tensor)
        # u starts at 0, so the first step is (1 - dampening) g, as Adam's first moment.
        velocity = steps.scaled_sum(ops, velocity, tensor, alpha=self.momentum, beta=1.0 - self.dampening)
        self.state_store.save(ops, self.velocities, name, velocity)
        if self.nesterov:
            return steps.scaled_sum(ops, velocity, tensor, alpha=self.momentum, beta=1.0)
        return velocity

    def compensate(self, tensor, name, ops, overwrite=False):
        # The velocity is state: never written into. Without momentum it is the gradient itself.
        plain = self.momentum == 0.0 and self.dampening == 0.0
        return super().compensate(self.velocity_step(tensor, name, ops), name, ops,
                                  overwrite and plain)

    def __repr__(self):
        params = ", ".join(f"{k}={v!r}" for k, v in self.momentum_params().items())
        return f"{type(self).__name__}({params})"


class EFSignSGDMemory(MomentumMemory):
    """Error feedback as EF-signSGD states it, ``p = g + e``, ``e = p - C(p)``, with the learning
    rate left to the optimizer (constant rates fold into ``e``); on the velocity where the optimizer
    has momentum, taken over (``MomentumMemory``). Karimireddy et al., ICML 2019."""

    name = "efsignsgd"
