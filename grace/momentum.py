"""Momentum that an algorithm owns, taken over from the user's optimizer so that it is applied once.

Some algorithms must see the momentum before compression: DGC's momentum correction accumulates
the velocity, not the gradient, and masks it where entries were sent (Lin et al., ICLR 2018);
signum sends the sign of the momentum (Bernstein et al., ICML 2018); 1-bit SGD and EF-signSGD
diverge when error feedback's delayed residuals pass through the optimizer's momentum afterwards,
and train when the velocity is what they compress (as 1-bit Adam does, Tang et al., ICML 2021).
Left in the optimizer as well, the momentum would apply twice. A framework wrapper therefore reads
the wrapped optimizer's momentum (``OptimizerMomentum``), hands it to the pipeline
(``Pipeline.take_momentum``), and has the optimizer step without it (PyTorch: its momentum set
aside for each step, its settings left as the user set them; Keras and TF1: set to 0); the user's
script is unchanged. The
tensors that travel dense (below ``min_numel``, or during warm-up) then get the same momentum from
the pipeline, applied before the exchange (a sum of velocities is the velocity of the sum); so do
they where the momentum is given to the compressor, or is its own where no optimizer is seen (the
tape, a DDP hook), for it stands for the optimizer's there (``grace.takeover``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grace.validation import check_bool, check_fraction


@dataclass(frozen=True)
class OptimizerMomentum:
    """The momentum a wrapped optimizer would apply: ``u = momentum * u + (1 - dampening) * g``,
    with Nesterov's look-ahead ``g + momentum * u`` if ``nesterov``. ``source`` says where it was
    read (``"torch.optim.SGD momentum"``, ``"keras SGD momentum"``, ``"torch.optim.Adam betas[0]"``)."""

    momentum: float
    nesterov: bool = False
    dampening: float = 0.0
    source: str = "the optimizer's momentum"


class OwnsMomentum:
    """For a compressor or memory that applies the momentum itself. ``momentum=None`` (the default)
    means: the optimizer's, taken over by the wrapper (none where it has none, unless
    ``keeps_default_momentum``), or ``default_momentum`` where no optimizer is seen; an explicit
    value is used as given, and a wrapped optimizer with momentum of its own is then refused (the
    momentum would apply twice)."""

    default_momentum: float = 0.0
    keeps_default_momentum: bool = False
    """Whether ``default_momentum`` stays when the wrapped optimizer has no momentum (signum: its
    algorithm is the sign of a momentum). Otherwise the optimizer is taken as it is: without
    momentum there, none here (measured: DGC's 0.9 added to a plain SGD multiplied its steps by
    ten and cost the words model 29% of perplexity, docs/quality.md). The default stays where
    no optimizer is seen (``DistributedGradientTape``)."""
    momentum_param: str = "momentum"
    """The constructor's name for the momentum (signum's is ``beta``)."""
    takes_adam_beta1: bool = False
    """Whether Adam's first-moment decay is taken over as well (measured to help signum and DGC:
    Adam then normalizes the compressed velocity instead of a momentum of it)."""

    def _init_momentum(self, momentum: float | None, nesterov: bool = False,
                       dampening: float = 0.0) -> None:
        self.momentum_given = None if momentum is None else check_fraction(self.momentum_param, momentum)
        self.momentum = self.default_momentum if momentum is None else self.momentum_given
        self.nesterov = check_bool("nesterov", nesterov)
        self.dampening = check_fraction("dampening", dampening)
        if self.nesterov and self.dampening:
            raise ValueError("nesterov momentum requires dampening=0 (as torch.optim.SGD)")

    def momentum_params(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "nesterov": self.nesterov, "dampening": self.dampening}

    def takeover_line(self, found: OptimizerMomentum, compressor: str) -> str:
        """What the wrapper logs once when it hands ``found`` over."""
        look = ", Nesterov" if found.nesterov else ""
        return (f"grace: {compressor} applies {found.source} ({found.momentum}{look}) itself, before "
                f"compression, and the optimizer steps without it, so that it applies once; "
                f"grace.{compressor}(keep_optimizer=True) leaves it to the optimizer")

    def kept_line(self, found: OptimizerMomentum, compressor: str) -> str | None:
        """What the wrapper logs once when the optimizer has no momentum and this part keeps its
        own default (``keeps_default_momentum``: signum), else ``None``."""
        if not self.keeps_default_momentum or self.momentum_given is not None or not self.momentum:
            return None
        return (f"grace: {compressor} applies its own momentum ({self.momentum_param} "
                f"{self.momentum}), the sign of a momentum being its algorithm, though "
                f"{found.source} is 0; {compressor}({self.momentum_param}=0) sends the sign of the "
                f"gradient (signSGD)")

    def dropped_default_line(self, compressor: str) -> str | None:
        """What the wrapper logs once where ``keep_optimizer=True`` drops this part's default
        momentum (none given), else ``None``."""
        if self.momentum_given is not None or not self.default_momentum:
            return None
        return (f"grace: {compressor}(keep_optimizer=True) applies none of its default momentum "
                f"({self.momentum_param} {self.default_momentum}): the optimizer's own applies, "
                f"after the exchange; pass {self.momentum_param}= to give it one")

    def unseen_optimizer_line(self, compressor: str, wrapper: str = "DistributedGradientTape"
                              ) -> str | None:
        """What the wrapper logs once where it sees no optimizer (``DistributedGradientTape``, a DDP
        communication hook: ``wrapper`` names it), so that none is taken over: the momentum this
        part applies itself, or how to give it one. ``None`` where the user gave the momentum
        explicitly."""
        if self.momentum_given is not None:
            return None
        if self.momentum:
            return (f"grace: {compressor} applies its own momentum ({self.momentum_param} "
                    f"{self.momentum}) before compression, and {wrapper} sees no "
                    f"optimizer to take it from: give the optimizer no momentum (it would apply "
                    f"twice), or pass {compressor}({self.momentum_param}=...) the value you want")
        return (f"grace: {compressor} applies the momentum itself, before compression, where it is "
                f"given one, and {wrapper} sees no optimizer to take it from: pass "
                f"{compressor}({self.momentum_param}=0.9) and give the optimizer no momentum "
                f"(applied after error feedback, an optimizer's momentum acts on what the "
                f"residual sends late: measured, 1-bit SGD diverges that way and top-k ends up to "
                f"2.4 points lower, docs/quality.md)")

    def take_momentum(self, found: OptimizerMomentum) -> None:
        if self.momentum_given is not None:
            raise ValueError(
                f"{self.momentum_param}={self.momentum_given} was given to the compression and "
                f"{found.source} is {found.momentum}: both would apply. Leave {self.momentum_param} "
                f"unset in grace (it takes the optimizer's over), or set the optimizer's to 0")
        self.momentum, self.nesterov, self.dampening = found.momentum, found.nesterov, found.dampening


def owner(pipeline: Any) -> OwnsMomentum | None:
    """The part of ``pipeline`` (its memory or its compressor) that applies the momentum, if any."""
    for part in (pipeline.memory, pipeline.compressor):
        if isinstance(part, OwnsMomentum):
            return part
    return None
