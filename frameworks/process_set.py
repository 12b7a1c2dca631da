"""What both frameworks' Horovod collectives share: the process set they run in."""

from __future__ import annotations


class ProcessSetCollectives:
    """The size and rank of a Horovod process set (the global one by default); the framework
    subclasses add the operations."""

    def __init__(self, process_set, global_process_set):
        self.process_set = process_set if process_set is not None else global_process_set

    @property
    def size(self) -> int:
        return self.process_set.size()

    @property
    def rank(self) -> int:
        return self.process_set.rank()


def gather_objects(hvd, obj, process_set, name: str) -> list:
    """Every worker's ``obj``, in rank order, with ``hvd`` the framework's Horovod module. Horovod
    0.28.1's ``allgather_object`` covers the global set; a sub-set takes a broadcast per member."""
    if process_set == hvd.global_process_set:
        return hvd.allgather_object(obj, name=name)
    return [hvd.broadcast_object(obj, root_rank=r, name=f"{name}.{r}", process_set=process_set)
            for r in process_set.ranks]
