"""What both frameworks' Horovod collectives share: the process set they run in."""

from __future__ import annotations

import logging
import os
from typing import Any

from grace import heap
from grace.collectives import Solo


def log_once(line: str | None, process_set) -> None:
    """``line`` as one warning of the ``grace`` logger, from the process set's rank 0 only (a
    wrapper's takeover or caution, said once per job rather than once per worker)."""
    if line is not None and process_set.included() and process_set.rank() == 0:
        logging.getLogger("grace").warning(line)


_TOLD: set = set()


def say_once(line: str | None, process_set, key: Any = None) -> None:
    """``log_once``, the first time this process meets ``line`` (or ``key``) only: for what is said
    where it happens again (a tape built at every eager step or trace, a wrapper built twice)."""
    key = line if key is None else key
    if line is not None and key not in _TOLD:
        _TOLD.add(key)
        log_once(line, process_set)


HEAP_LINE = (f"grace: glibc's heap now keeps freed memory, process-wide (blocks up to "
             f"{heap.MMAP_THRESHOLD >> 20} MiB from the heap, up to {heap.TRIM_THRESHOLD >> 30} GiB "
             f"of free heap kept mapped), so that each step reuses the last one's pages instead of "
             f"having fresh ones zeroed (docs/setup.md); {heap.ENV}=0 leaves glibc as it is")


def announce(pipeline: Any, process_set, optimizer_seen: bool = True,
             wrapper: str = "DistributedGradientTape") -> None:
    """Set glibc's heap for the steps (``grace.heap``), and say once on rank 0 each way grace
    departs from what the user set (``Pipeline.notices``; ``wrapper`` names one that sees no
    optimizer), as every wrapper does when it is built. ``process_set``: anything with Horovod's
    process set's ``included()``, ``rank()`` and ``size()``."""
    if heap.keep_freed_memory():
        say_once(HEAP_LINE, process_set)
    for line in pipeline.notices(process_set.size(), optimizer_seen, wrapper):
        say_once(line, process_set)


ELASTIC_LINE = ("grace: Horovod elastic: the workers' compression is not compared as the wrapper is "
                "built (a worker that joins builds it while the others synchronize their state, and "
                "the comparison's collective would hang the job); build the same compression on "
                "every worker (docs/reliability.md)")


def elastic() -> bool:
    """Whether this worker is part of a Horovod elastic job (``HOROVOD_ELASTIC=1``, which
    ``horovodrun --min-np``/``--host-discovery-script`` sets): workers may leave and join between
    steps, a joining one knowing nothing of what the others agreed before."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def compares_at_construction(process_set) -> bool:
    """Whether a wrapper compares the workers' compression as it is built, which is a collective:
    not in a Horovod elastic job (``elastic``), where a joining worker builds its wrapper alone while
    the others are in ``state.sync()``; said once on rank 0."""
    if elastic():
        say_once(ELASTIC_LINE, process_set)
        return False
    return True


class ProcessSetCollectives:
    """The size and rank of a Horovod process set (the global one by default); the framework
    subclasses add the operations and name their Horovod module (``horovod``)."""

    horovod = None

    def __init__(self, process_set, global_process_set):
        self.process_set = process_set if process_set is not None else global_process_set
        self._hosts = None

    def global_rank(self, rank: int) -> int:
        """Horovod's rank of this process set's worker ``rank`` (a broadcast's root is given so)."""
        ranks = getattr(self.process_set, "ranks", None)
        return ranks[rank] if ranks else rank

    def hosts(self):
        """(the workers of this worker's host, the workers of its local rank on every host), as
        collectives of this class (``hierarchical=True``; see ``host_sets``). A group of one is a
        ``Solo``."""
        if self._hosts is None:
            local, cross = host_sets(self.horovod, self.process_set)
            self._hosts = tuple(Solo() if ps is None else type(self)(ps) for ps in (local, cross))
        return self._hosts

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


_HOST_SETS: dict = {}


def host_sets(hvd, process_set) -> tuple:
    """Horovod process sets of the workers of this worker's host and of the workers of its local
    rank on every host (``None`` for a worker alone in one), made once per process: every worker
    adds every set, in the same order, as Horovod requires. Needs the same number of workers on
    every host, placed host after host (as horovodrun and mpirun place them), and Horovod's dynamic
    process sets. No collective is needed (a traced graph may build it)."""
    if hvd.__name__ in _HOST_SETS:
        return _HOST_SETS[hvd.__name__]
    if process_set != hvd.global_process_set:
        raise ValueError("hierarchical=True groups the workers by host within the whole job: use it "
                         "with the global process set")
    size, per_host = hvd.size(), hvd.local_size()
    if hvd.cross_size() * per_host != size:
        raise ValueError(f"hierarchical=True needs the same number of workers on every host; this "
                         f"one has {per_host} of the job's {size} on {hvd.cross_size()} hosts")
    if hvd.rank() != hvd.cross_rank() * per_host + hvd.local_rank():
        raise ValueError(f"hierarchical=True needs the workers placed host after host (rank = host "
                         f"x {per_host} + local rank), as horovodrun places them; rank {hvd.rank()} "
                         f"is local rank {hvd.local_rank()} of host {hvd.cross_rank()}")
    hosts = size // per_host
    groups = ([tuple(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
              + [tuple(range(local, size, per_host)) for local in range(per_host)])
    made: dict = {}
    for ranks in groups:
        if ranks in made:
            continue
        if len(ranks) == size:
            made[ranks] = hvd.global_process_set
        elif len(ranks) == 1:
            made[ranks] = None
        else:
            try:
                made[ranks] = hvd.add_process_set(list(ranks))
            except ValueError as e:
                raise ValueError(
                    "hierarchical=True adds Horovod process sets (each host's workers, and each "
                    "local rank's across the hosts), which needs Horovod's dynamic process sets: "
                    "launch with HOROVOD_DYNAMIC_PROCESS_SETS=1 in the environment "
                    f"(Horovod said: {e})") from e
    mine = (groups[hvd.cross_rank()], groups[hosts + hvd.local_rank()])
    _HOST_SETS[hvd.__name__] = (made[mine[0]], made[mine[1]])
    return _HOST_SETS[hvd.__name__]
