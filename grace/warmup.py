"""The warm-up: the first exchanges of each tensor travel dense before compression starts
(``warmup_steps``)."""

from __future__ import annotations

from typing import Any, Callable

from grace.ops import Ops, Tensor
from grace.state import StateStore


class Warmup:
    """The first ``steps`` exchanges of each tensor travel dense (allreduce, no memory), as
    PyTorch's PowerSGD hook (``start_powerSGD_iter``), DGC's warm-up epochs (Lin et al., "Deep
    Gradient Compression", ICLR 2018) and 1-bit Adam's freeze step (Tang et al., ICML 2021) do:
    early gradients are large and change fast, which delayed residuals and quantization noise
    handle worst. Exchanges are counted per tensor, skipped steps included; the count
    (``exchanges``) is saved state, written through the pipeline's ``state_store`` so that a step
    dropped for a non-finite gradient leaves it as it was.

    Eagerly the count is a number and ``dense_now`` says which way this exchange goes. In a traced
    graph (``tf.function``) it is a tensor known only when the graph runs: ``traced`` builds both
    ways and lets the count pick one then."""

    def __init__(self, steps: int, state_store: StateStore):
        self.steps = steps
        self.state_store = state_store
        self.exchanges: dict = {}  # per tensor: how many exchanges have been counted

    def exchanges_of(self, name: str, ops: Ops) -> Any:
        """How many exchanges of ``name`` were counted: an int eagerly, a tensor in a trace."""
        return self.state_store.counter(ops, self.exchanges, name, 0)

    def dense_now(self, exchanges: int) -> bool:
        return exchanges < self.steps

    def count(self, name: str, ops: Ops) -> Any:
        """Count one exchange of ``name``, within the transaction the caller is in; the count
        before it."""
        return self.state_store.counter(ops, self.exchanges, name)

    def traced(self, name: str, exchanges: Tensor, way: Callable[[bool], Tensor], check_finite: bool,
               discard: Tensor, ops: Ops) -> Tensor:
        """Both ways built (``way(dense)``), the count choosing one when the graph runs; the count
        is committed there too, unless ``discard`` (the step's verdict) is set."""
        result = ops.cond(exchanges < self.steps, lambda: way(True), lambda: way(False))
        counted: dict | None = {} if check_finite else None
        with self.state_store.within(counted):
            self.count(name, ops)
        if counted is not None:
            self.state_store.commit(ops, counted, ops.is_set(discard))
        return result
