"""What a framework adapter provides for moving tensors between workers.

The communicators of ``grace.communicators`` are written against this protocol; Horovod's async ops sit
behind it in ``frameworks/<fw>/collectives.py``, and ``grace.backends`` offers an in-process and an
mpi4py implementation over numpy arrays.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from grace.ops import Tensor

Handle = Any


@runtime_checkable
class Collectives(Protocol):
    """Asynchronous collectives among the workers of one group (a Horovod process set).

    ``*_async`` start an operation and return at once; ``synchronize`` waits for it and returns its
    result. Names identify an operation across workers, as in Horovod: every worker starts the same
    names, in any order.
    """

    @property
    def size(self) -> int:
        """How many workers take part."""

    @property
    def rank(self) -> int:
        """This worker's rank within the group."""

    def allreduce_async(self, tensor: Tensor, name: str) -> Handle:
        """Start the element-wise sum of ``tensor`` over all workers."""

    def allgather_async(self, tensor: Tensor, name: str) -> Handle:
        """Start concatenating every worker's 1-d ``tensor``, in rank order (lengths may differ)."""

    # Optional: ``fuses_sums``, true where the layer below fuses small allreduces itself and starts
    # each as soon as its input exists (Horovod's TensorFlow ops in a traced graph): the pipeline
    # then neither joins a bucket's summed tensors nor packs their payloads into one buffer, which
    # there only makes the first tensor wait for the last and copies every byte twice
    # (``sums_fused``).
    # Optional: ``allgather_equal_async(tensor, name)``, ``allgather_async`` where every worker's
    # tensor has the same length, for a layer that must otherwise exchange the lengths first
    # (``frameworks/torch/distributed.py``); the communicators call it where it exists.
    # Optional: ``allreduce_given_async(tensor, name)``, ``allreduce_async`` of a tensor the caller
    # gives over: the sum may be written into it, which saves a copy of the payload (``Allreduce``
    # gives over what it joined itself, and the payloads that nothing reads after they are sent).

    def broadcast_async(self, tensor: Tensor, root: int, name: str) -> Handle:
        """Start sending ``root``'s ``tensor`` to every worker (the others pass a same-shaped one)."""

    def alltoall_async(self, tensor: Tensor, splits: Tensor, name: str) -> Handle:
        """Start sending, to each worker ``j`` in rank order, the next ``splits[j]`` elements of the
        1-d ``tensor`` (``splits``: a 1-d int32 tensor); the result is what every worker sent this
        one, concatenated in rank order (Horovod's alltoall, its received splits left out)."""

    def synchronize(self, handle: Handle) -> Tensor:
        """Wait for an operation and return its result."""


def sums_fused(group) -> bool:
    """Whether ``group``'s allreduces are best issued one per tensor (``fuses_sums``)."""
    return bool(getattr(group, "fuses_sums", False))


class Solo:
    """A group of one worker: every collective returns what it was given (a host with one worker,
    under ``hierarchical=True``)."""

    size = 1
    rank = 0

    def allreduce_async(self, tensor: Tensor, name: str) -> Handle:
        return tensor

    def allgather_async(self, tensor: Tensor, name: str) -> Handle:
        return tensor

    def broadcast_async(self, tensor: Tensor, root: int, name: str) -> Handle:
        return tensor

    def alltoall_async(self, tensor: Tensor, splits: Tensor, name: str) -> Handle:
        return tensor

    def synchronize(self, handle: Handle) -> Tensor:
        return handle
