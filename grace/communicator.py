"""The ``Communicator`` interface: how payloads travel between workers, in two phases."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from grace.collectives import Collectives
from grace.compressor import Compressor, Payload
from grace.ops import Ops


class Communicator(ABC):
    """Moves one tensor's payload between the workers of a group.

    ``start`` issues the collectives and returns at once, so that a framework can overlap
    communication with the rest of the backward pass; ``finish`` waits and returns the payloads to
    decompress: one per worker, or a single one already summed over workers when the collective adds
    (which is valid only for a ``summable`` compressor).
    """

    name: ClassVar[str] = "abstract"

    def bind(self, compressor: Compressor) -> None:
        """Called once with the pipeline's compressor: raise ``ValueError`` if this communicator would
        give wrong results with it, or remember what it needs to know of it."""

    @abstractmethod
    def start(self, payload: Payload, name: str, group: Collectives, ops: Ops) -> Any: ...

    @abstractmethod
    def finish(self, handle: Any, group: Collectives, ops: Ops) -> list[Payload]: ...

    @abstractmethod
    def bytes_sent(self, payload: Payload, group: Collectives, ops: Ops) -> int:
        """Payload bytes this worker puts into the collectives of one ``start``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
