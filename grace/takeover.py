"""The optimizer takeover: what the pipeline takes over from the user's optimizer, and says so.

Some algorithms apply momentum themselves (DGC's velocity before the top-k, signum's, 1-bit's,
random-k's error feedback that must not be followed by momentum): the wrapped optimizer's momentum
is handed to the part that applies it, and the optimizer steps without it (``grace.momentum``).
Random-k with Adam takes Adam's second moment over (``grace.second_moment``). ``Takeover`` is the
one object every wrapper asks: the Horovod wrappers hand it the optimizer's settings they find; a
DDP hook, which never sees the optimizer, leaves it untouched (the compressor's own arguments
apply). Every change to what the user set comes with a sentence for the wrapper to log once on
rank 0."""

from __future__ import annotations

from typing import Any, Callable

from grace.communicator import Communicator
from grace.compressor import Compressor
from grace.memories.momentum import MomentumMemory
from grace.memories.none import NoneMemory
from grace.memory import Memory
from grace.momentum import OptimizerMomentum, OwnsMomentum, owner
from grace.second_moment import SharedSecondMoment
from grace.sparse import RowVelocity


class Takeover:
    """The optimizer's momentum and Adam's moments, once taken over, for a pipeline's
    ``compressor``, ``memory`` and ``communicator``. ``keep_optimizer``: leave the optimizer as
    the user set it (nothing taken, no default momentum added). ``own`` gives a part made here the
    pipeline's state store. ``dense_memory`` is the memory of the tensors that travel dense: the
    taken momentum, applied before the exchange, so that every tensor keeps the momentum the
    optimizer gave it; ``row_velocity`` is the same for sparse gradients' rows."""

    def __init__(self, compressor: Compressor, memory: Memory, communicator: Communicator,
                 keep_optimizer: bool, own: Callable[..., None]):
        self.compressor = compressor
        self.memory = memory
        self.communicator = communicator
        self.keep_optimizer = keep_optimizer
        self._own = own
        self.dense_memory: Memory = NoneMemory()
        self.row_velocity = RowVelocity()
        self.taken: tuple | None = None  # (momentum, nesterov, dampening) once taken over
        self.moments: SharedSecondMoment | None = None  # Adam's second moment, once taken over
        self._kept_notes: list[str] = []  # said by take_momentum where it changed nothing
        own(self.dense_memory, self.row_velocity)
        part = self.part
        if keep_optimizer and part is not None and part.momentum_given is None:
            part.momentum = 0.0  # nothing of the optimizer's is taken, and no default added
        if (not keep_optimizer and part is not None and part.momentum
                and (part.momentum_given is not None or not part.keeps_default_momentum)):
            # Given (dgc(momentum=0.9)), or DGC's default where no optimizer is seen: the momentum
            # stands for the optimizer's, which the user is told to leave at 0, so the tensors
            # that travel dense get it too, as they do when it is taken from the optimizer.
            # Signum's own beta is its algorithm, the sign of an average, not the optimizer's:
            # the dense tensors step as the optimizer says, as under the wrapper.
            self._dense_momentum(part, (part.momentum, part.nesterov, part.dampening))

    @property
    def part(self) -> OwnsMomentum | None:
        """The part (the memory or the compressor) that applies momentum itself, if any."""
        return owner(self)

    def take_momentum(self, found: OptimizerMomentum, adam: bool = False) -> str | None:
        """Hand the wrapped optimizer's momentum (``found``) to the part that applies momentum
        itself, if there is one; the caller then has the optimizer step without it. Returns the
        sentence to log once, or ``None`` when nothing was taken (``adam``: ``found`` is Adam's
        ``beta_1``, taken only by the algorithms that ask for it)."""
        part = self.part
        if part is None or (adam and not part.takes_adam_beta1) or self.keep_optimizer:
            return None
        if found.momentum == 0.0:
            if part.momentum_given is None:
                # The optimizer as it is: no momentum there, none here; where the part keeps its
                # default (signum's beta, its algorithm), the dense tensors still step as the
                # optimizer says, without.
                if not part.keeps_default_momentum:
                    part.momentum = 0.0
                if self.dense_momentum:  # DGC's default, set where no optimizer was yet seen
                    self._dense_plain()
            kept = part.kept_line(found, self.compressor.name)
            if kept is not None:
                self._kept_notes.append(kept)
            return None
        self._apply(part, found)
        return part.takeover_line(found, self.compressor.name)

    def retake_momentum(self, found: OptimizerMomentum) -> None:
        """The momentum taken over, as the optimizer's settings now say it (they may have been
        replaced since: ``hvd.broadcast_optimizer_state`` gives every worker rank 0's, a resumed
        ``load_state_dict`` the saved ones). Nothing changes when they are as taken, or when none
        was taken. The velocities are kept."""
        if self.taken is None or self.taken == (found.momentum, found.nesterov, found.dampening):
            return
        self._apply(self.part, found)

    def _apply(self, part: Any, found: OptimizerMomentum) -> None:
        part.take_momentum(found)
        # The optimizer's, not the part's: random-k takes it to turn it off on what it compresses.
        self.taken = (found.momentum, found.nesterov, found.dampening)
        self._dense_momentum(part, self.taken)

    @property
    def dense_momentum(self) -> bool:
        """Whether the tensors that travel dense, and sparse gradients' rows, get a momentum here,
        before the exchange (the optimizer's taken over, or the one given to the compression)."""
        return isinstance(self.dense_memory, MomentumMemory)

    def _dense_plain(self) -> None:
        self.dense_memory = NoneMemory()
        self._own(self.dense_memory)
        rows = self.row_velocity
        rows.momentum, rows.nesterov, rows.dampening = 0.0, False, 0.0

    def _dense_momentum(self, part: Any, params: tuple[float, bool, float]) -> None:
        """The dense tensors' memory and the sparse rows' velocity at the momentum ``params``."""
        if isinstance(self.dense_memory, MomentumMemory):  # retaken: the same velocities
            dense = self.dense_memory
            dense.momentum, dense.nesterov, dense.dampening = params
        else:
            dense = MomentumMemory(*params)
            if isinstance(part, MomentumMemory) and part.momentum_params() == dense.momentum_params():
                # One velocity per tensor: a warm-up's dense steps build what compression continues.
                dense.velocities = part.velocities
        self._own(dense)
        self.dense_memory = dense
        rows = self.row_velocity
        rows.momentum, rows.nesterov, rows.dampening = params

    def take_adam_moments(self, beta2: float, eps: float, averaged: bool, plain_route: bool
                          ) -> str | None:
        """Take the wrapped Adam's moments over, where the compressor steps better with them
        (random-k: ``grace.second_moment``): its compressed tensors then come out of the exchange
        as the update to step by the learning rate, ``burst / (sqrt(v) + eps)``. Needs the
        compressor's own error feedback (a memory that observes the second moment) over a
        communicator that sums as sent, on the pipeline's plain route (``plain_route``: tensor by
        tensor, not hierarchical, no warm-up), and workers' gradients averaged (``averaged``):
        where one of those is not so, nothing is taken (``None``). Called again before each step
        with the optimizer's settings as they are then."""
        if not (self.compressor.can_take_second_moment and averaged and not self.keep_optimizer
                and self.memory.observes_second_moment and self.communicator.sums and plain_route):
            return None
        if self.moments is not None:
            self.moments.retake(beta2, eps)
            return None
        moments = SharedSecondMoment(beta2, eps)
        self._own(moments)
        self.moments = self.compressor.moments = self.memory.moments = moments
        return (f"grace: {self.compressor.name} takes Adam's moments over for the tensors it "
                f"compresses: it divides its error feedback's updates by every worker's second "
                f"moment (beta2 {moments.beta2}, eps {moments.eps}), sent with the drawn entries "
                f"(twice the values), steps them by the learning rate without a first moment "
                f"(momentum on ~1/ratio-step-late updates diverges), and the optimizer steps the "
                f"rest as it is (docs/quality.md, 'With Adam'); "
                f"grace.{self.compressor.name}(take_adam_moments=False) leaves Adam as it is")

    def adam_caution(self, optimizer: str) -> str | None:
        """The line a wrapper logs once when the pipeline wraps Adam (``optimizer`` names it),
        where the compressor is measured to fall short with Adam (``Compressor.adam_caution``)
        and did not take Adam's moments over, else ``None``."""
        caution = self.compressor.adam_caution
        if caution is None or self.moments is not None:
            return None
        return f"grace: {self.compressor.name} with {optimizer}: {caution}"

    def shortfall_notice(self) -> str | None:
        """``Compressor.shortfall_notice`` where the compression is the one measured: the
        compressor's default parameters and memory, no momentum given. A user who set any of them
        (``qsgd(levels=127)``, ``dgc(momentum=0.9)``) runs something the line does not describe."""
        compressor, part = self.compressor, self.part
        measured = (compressor.params() == type(compressor)().params()
                    and self.memory.name == compressor.default_memory
                    and (part is None or part.momentum_given is None))
        return compressor.shortfall_notice() if measured else None

    def notices(self, size: int, optimizer_seen: bool, wrapper: str) -> list[str]:
        """The sentences a wrapper logs once on rank 0 when it is built for a job of ``size``
        workers: each way the pipeline departs from what the user set and nothing else says
        (the takeover lines aside): a compressor's floor under its ratio, the models it is
        measured short on with the setting that works there (``Compressor.shortfalls``), the route
        ``communicator="auto"`` takes at this size, a compressor's own momentum kept over an
        optimizer without one, and, where the wrapper sees no optimizer (``optimizer_seen=False``:
        ``DistributedGradientTape``, or a DDP hook: ``wrapper`` names it), the momentum a
        compressor applies itself or needs to be given."""
        lines = [self.compressor.notice(), self.shortfall_notice(),
                 self.communicator.notice(size, self.compressor.name),
                 *self._kept_notes]
        part = self.part
        if not optimizer_seen and part is not None and not self.keep_optimizer:
            lines.append(part.unseen_optimizer_line(self.compressor.name, wrapper))
        if self.keep_optimizer and part is not None:
            lines.append(part.dropped_default_line(self.compressor.name))
        if not optimizer_seen:
            lines.append(self.compressor.learning_rate_notice(None))
        return [line for line in lines if line is not None]
