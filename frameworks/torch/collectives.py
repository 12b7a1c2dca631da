"""``grace.collectives.Collectives`` over Horovod's asynchronous torch ops."""

from __future__ import annotations

import horovod.torch as hvd


class HorovodCollectives:
    """Horovod's async allreduce (sum), allgather and broadcast among one process set."""

    def __init__(self, process_set=None):
        self.process_set = process_set if process_set is not None else hvd.global_process_set

    @property
    def size(self) -> int:
        return self.process_set.size()

    @property
    def rank(self) -> int:
        return self.process_set.rank()

    def allreduce_async(self, tensor, name):
        return hvd.allreduce_async(tensor, name=name, op=hvd.Sum, process_set=self.process_set)

    def allgather_async(self, tensor, name):
        return hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    def broadcast_async(self, tensor, root, name):
        return hvd.broadcast_async(tensor, root_rank=root, name=name, process_set=self.process_set)

    def synchronize(self, handle):
        return hvd.synchronize(handle)
