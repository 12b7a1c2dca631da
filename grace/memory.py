"""The ``Memory`` interface: what a compressor's error feedback keeps between steps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from grace.compressor import Compressor, Context, Payload
from grace.ops import Ops, Tensor
from grace.state import DEFAULT, StateStore


class Memory(ABC):
    """Per-tensor state kept by a worker across steps, keyed by the tensor's name.

    ``compensate`` runs before compression and may add to the gradient what earlier steps left out;
    ``update`` runs after it and records what this step's payload leaves out.
    """

    name: ClassVar[str] = "abstract"
    stateless: ClassVar[bool] = False
    """Whether it keeps nothing between steps (``NoneMemory``): a tensor it passes has no state
    to roll back."""
    observes_second_moment: ClassVar[bool] = False
    """Whether it folds each gradient into Adam's second moment when that is taken over
    (``DelayedResidualMemory``, ``grace.second_moment``)."""
    state_store: StateStore = DEFAULT
    """Where state kept across steps is read and written (``grace.state``): the pipeline's own."""

    @abstractmethod
    def compensate(self, tensor: Tensor, name: str, ops: Ops, overwrite: bool = False) -> Tensor:
        """The tensor to compress: ``tensor`` with what earlier steps left out added. With
        ``overwrite`` the caller reads ``tensor`` no more (a gradient the exchange replaces), and
        the result may be written into it (``Ops.add_into``) instead of into a new tensor."""

    @abstractmethod
    def update(self, compensated: Tensor, name: str, compressor: Compressor, payload: Payload,
               ctx: Context, ops: Ops) -> None: ...

    def state(self) -> dict[str, dict]:
        """The state kept between steps: this memory's dict attributes, each keyed by tensor
        name."""
        return {k: v for k, v in vars(self).items() if isinstance(v, dict)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
