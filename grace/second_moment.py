"""Adam's second moment, taken over by random-k: every worker's dense gradients, exchanged with the
drawn entries, divide the error-feedback updates (``SharedSecondMoment``).

Random-k with error feedback sends each element about every ``1 / ratio`` steps, with all it
accumulated meanwhile. Given to the user's Adam, those bursts shrink its steps: Adam divides each
element by the root mean square of what it receives, and a burst of ``D`` steps of a steady gradient
``g`` has a root mean square of ``sqrt(D) g`` over the steps, so the element moves ``sqrt(D)`` times
less than under uncompressed Adam (measured: 1.1 to 1.7 points short on mnist, docs/quality.md,
"With Adam"). Every remedy that gives Adam values of the gradient's size on every step (bursts
spread out, estimates held, a frozen variance with Adam's momentum) diverges: the information is
~``D`` steps late, and late steps of full size are unstable.

What trains is to keep the bursts, and divide them by the second moment Adam would have from the
dense gradients: ``update = burst / (sqrt(v) + eps)``, stepped by the learning rate, with no first
moment (momentum on bursts diverges, as with SGD, ``DelayedResidualMemory``): each element then moves,
over the steps, by what uncompressed RMSprop-style Adam moves it, only late, as random-k moves an
SGD model. ``v`` must be the same on every worker, and no worker has the dense average gradient.
Each worker keeps ``v`` of its own gradients (``v = beta2 v + (1 - beta2) g²``, bias-corrected as
Adam's), and random-k's payload carries ``v``'s drawn entries beside the values: one allreduce
averages both, and each worker's shared estimate takes the average at exactly the entries whose
bursts arrive in the same step (the others keep theirs: ``v`` changes over ~``1 / (1 - beta2)``
steps, far slower than it is refreshed). The payload doubles (``2 k`` values, the indices are
never sent). A worker's own gradient is noisier than the average, so ``v`` is somewhat larger
than Adam's (at most by the noise's share), which makes steps of noisy elements somewhat smaller.

Where the idea comes from: 1-bit Adam (Tang et al., ICML 2021) and 0/1 Adam (Lu et al., ICLR 2023)
divide compressed momentum by a variance taken from dense gradients (frozen after a warm-up, which
here diverged once a stale small entry met a large burst); Chen et al. (ACM TIST 2021) exchange
Adam's updates with error feedback. Refreshing the variance with the drawn entries keeps it
current where the bursts land.
"""

from __future__ import annotations

from grace.ops import Ops, Tensor
from grace.state import DEFAULT, StateStore
from grace.validation import check_fraction


class SharedSecondMoment:
    """Adam's second moment for random-k's error-feedback bursts (see the module docstring):
    ``observe`` folds this worker's gradient into its own ``v``; ``drawn`` is the bias-corrected
    ``v`` at the drawn entries, to travel with their values; ``precondition`` takes the workers'
    average there into the shared estimate and divides the combined burst by its root.

    ``beta2`` and ``eps`` are the wrapped Adam's (``betas[1]`` and ``eps``; Keras's ``beta_2`` and
    ``epsilon``), read again before each step where the optimizer's settings may have changed."""

    def __init__(self, beta2: float, eps: float):
        self.beta2, self.eps = self.settings(beta2, eps)
        self.local: dict = {}  # per tensor: this worker's v of its own gradients
        self.weights: dict = {}  # per tensor: 1 - beta2 ** t, v's bias correction
        self.shared: dict = {}  # per tensor: the workers' average v, as last drawn
        self.state_store: StateStore = DEFAULT

    @staticmethod
    def settings(beta2: float, eps: float) -> tuple[float, float]:
        beta2 = check_fraction("beta2", beta2)  # in [0, 1)
        if not eps >= 0.0:
            raise ValueError(f"Adam's eps must be at least 0, got {eps}")
        return beta2, float(eps)

    def retake(self, beta2: float, eps: float) -> None:
        """The optimizer's settings as they are now (a resumed or broadcast state may replace
        them); the moments are kept."""
        self.beta2, self.eps = self.settings(beta2, eps)

    def observe(self, tensor: Tensor, name: str, ops: Ops) -> None:
        """Fold this worker's gradient ``tensor`` into its own ``v``."""
        flat = ops.flatten(tensor)
        v = self.state_store.load(ops, self.local, name, like=flat)
        squared = ops.scale(ops.mul(flat, flat), 1.0 - self.beta2)
        self.state_store.save(ops, self.local, name,
                              squared if v is None else ops.add(ops.scale(v, self.beta2), squared))
        one = ops.zeros(1, ops.dtype(flat), like=flat)
        weight = self.state_store.load(ops, self.weights, name, like=one)
        step = ops.full(1, 1.0 - self.beta2, ops.dtype(flat), like=flat)
        self.state_store.save(ops, self.weights, name,
                              step if weight is None else ops.add(ops.scale(weight, self.beta2), step))

    def drawn(self, name: str, indices: Tensor, ops: Ops, like: Tensor) -> Tensor:
        """This worker's bias-corrected ``v`` at ``indices`` (after ``observe`` of this step);
        zeros for a tensor never observed (the compressor used on its own, outside a pipeline)."""
        v = self.state_store.load(ops, self.local, name, like=like)
        weight = self.state_store.load(ops, self.weights, name,
                                       like=ops.zeros(1, ops.dtype(like), like=like))
        if v is None or weight is None:
            return ops.zeros(ops.numel(indices), ops.dtype(like), like=like)
        return ops.div(ops.gather(v, indices), weight)

    def precondition(self, burst: Tensor, mean: Tensor, indices: Tensor, name: str,
                     ops: Ops) -> Tensor:
        """The combined 1-d ``burst`` divided by ``sqrt(v) + eps``, where the shared ``v`` takes
        the workers' average ``mean`` at ``indices`` (the entries the burst holds)."""
        n = ops.numel(burst)
        shared = self.state_store.load(ops, self.shared, name, like=burst)
        fresh = ops.scatter_add(n, indices, mean)
        shared = fresh if shared is None else ops.add(ops.zero_at(shared, indices), fresh)
        self.state_store.save(ops, self.shared, name, shared)
        eps = ops.full(1, self.eps, ops.dtype(burst), like=burst)
        return ops.div(burst, ops.add(ops.sqrt(shared), eps))

    def state(self) -> dict[str, dict]:
        return {"local": self.local, "weights": self.weights, "shared": self.shared}

    def __repr__(self) -> str:
        return f"SharedSecondMoment(beta2={self.beta2!r}, eps={self.eps!r})"
