"""The ``Communicator`` interface: how a bucket's payloads travel between workers, in two phases."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from grace.collectives import Collectives
from grace.compressor import Compressor, Payload
from grace.ops import Ops, Tensor


@dataclass
class Started:
    """A bucket's collectives in flight: the communicator's handle, whether the step's non-finite
    flag rides in them, and the bytes this worker put in (payload, and control: the flag); once
    finished, the payload bytes it received from the other workers, and those it put into
    collectives of its own finish (``alltoall``'s second stage)."""

    handle: Any
    carries_flag: bool
    bytes_sent: Any
    bytes_control: int = 0
    bytes_received: Any = 0
    bytes_later: Any = 0


class Communicator(ABC):
    """Moves the payloads of a bucket's tensors between the workers of a group, in as few
    collectives as it can (one per round: the payloads packed into one buffer).

    ``start`` issues the collectives and returns at once, so that a framework can overlap
    communication with the rest of the backward pass; it may carry the step's 1-element non-finite
    flag inside them. ``finish`` waits and returns, per payload, the payloads to decompress: one per
    worker, or a single one already summed over workers when the collective adds (which is valid
    only for a ``summable`` compressor); and the flag summed over workers, if it carried it.
    """

    name: ClassVar[str] = "abstract"
    shards: ClassVar[bool] = False
    """Whether payloads are encoded shard by shard for it (``ShardCodec``): one shard per worker."""
    sums: ClassVar[bool] = False
    """Whether the collective adds the payloads as they are sent (Horovod's allreduce): the
    receiver decodes one sum."""

    def bind(self, compressor: Compressor, memory: Any = None) -> None:
        """Called once with the pipeline's compressor and memory: raise ``ValueError`` if this
        communicator would give wrong results with them."""

    def notice(self, size: int, compressor: str) -> str | None:
        """A sentence saying what this communicator chooses for a job of ``size`` workers that the
        user did not name, for the wrapper to log once on rank 0; ``None`` when nothing."""
        return None

    @abstractmethod
    def start(self, payloads: Sequence[Payload], varies: Sequence[bool], flag: Tensor | None,
              tag: str, group: Collectives, ops: Ops, entries: Sequence[Any] = ()) -> Started:
        """Start moving ``payloads`` (``varies[i]``: whether payload i's sizes depend on the
        data, so that receivers must be told them); ``tag`` names the collectives, alike on every
        worker. ``entries``: the pipeline's units whose payloads these are (compressor, context,
        transaction), for a communicator that works on them between its collectives."""

    def resolve(self, size: int) -> "Communicator":
        """The communicator that carries a job of ``size`` workers (``auto`` decides by it)."""
        return self

    def relay(self, started: Started, group: Collectives, ops: Ops) -> None:
        """For a communicator of two stages: wait for the first and start the second, so that a
        step's buckets all have their second stage in flight before any is waited for (``finish``
        relays first if this was not called). Nothing for one stage."""

    @abstractmethod
    def finish(self, started: Started, group: Collectives, ops: Ops
               ) -> tuple[list[list[Payload]], Tensor | None]:
        """Wait; per payload what to decompress, and the flag summed over workers. Sets
        ``started.bytes_received``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
