"""Collectives over numpy arrays: in one process (workers simulated), or across processes with mpi4py.

``InProcessGroup`` lets a test or a study run N workers' pipelines in a single process: every worker
starts its operations, then every worker synchronizes, exactly as real workers would, and the results
are what Horovod would return.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from grace.ops import ops_for


class InProcessGroup:
    """N simulated workers in one process. ``group.worker(r)`` is worker ``r``'s ``Collectives``.

    Works on the tensors of any adapter (numpy, torch, TensorFlow): contributions are combined as
    numpy arrays and each worker gets its result back as a tensor of its own kind and device."""

    def __init__(self, size: int, timeout: float = 30.0, per_host: int | None = None):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if per_host is not None and (not isinstance(per_host, int) or per_host < 1 or size % per_host):
            raise ValueError(f"per_host must be a positive int that divides size ({size}), got "
                             f"{per_host!r}")
        self.size = size
        self.timeout = timeout
        self.per_host = per_host
        if per_host is not None:  # hosts of consecutive ranks, as Horovod's launcher places them
            self._local = [InProcessGroup(per_host, timeout) for _ in range(size // per_host)]
            self._cross = [InProcessGroup(size // per_host, timeout) for _ in range(per_host)]
        self._ops: dict[tuple[str, str], dict[int, Any]] = {}
        self._done: dict[tuple[str, str], int] = {}
        self._changed = threading.Condition()

    def worker(self, rank: int) -> "_InProcessWorker":
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {rank}")
        return _InProcessWorker(self, rank)

    def _contribute(self, key, rank, value):
        with self._changed:
            contributions = self._ops.setdefault(key, {})
            if rank in contributions:
                raise RuntimeError(f"worker {rank} started {key[0]} {key[1]!r} twice")
            contributions[rank] = value
            self._changed.notify_all()
        return key

    def _result(self, key, rank):
        with self._changed:
            # Workers driven from threads (as a two-round compressor needs) wait for each other here.
            complete = self._changed.wait_for(
                lambda: len(self._ops.get(key, {})) == self.size, timeout=self.timeout)
            if not complete:
                missing = sorted(set(range(self.size)) - set(self._ops.get(key, {})))
                raise RuntimeError(f"{key[0]} {key[1]!r}: workers {missing} have not started it")
            value, like = self._combine(key, rank)
        if like is None:
            return value
        ops = ops_for(like)  # numpy has no bfloat16: such tensors travel as float32 here
        return ops.cast(ops.from_numpy(value, like), ops.dtype(like))

    def _combine(self, key, rank):
        contributions = self._ops[key]
        kind = key[0]
        like = contributions[rank][2] if kind == "broadcast" else contributions[rank][1]
        contributions = {r: ((v[0], v[1]) if kind == "broadcast" else v[0])
                         for r, v in contributions.items()}
        if kind == "allreduce":
            result = np.sum(np.stack([contributions[r] for r in range(self.size)]), axis=0)
            result = result.astype(contributions[0].dtype)
        elif kind == "allgather":
            result = np.concatenate([np.reshape(contributions[r], -1) for r in range(self.size)])
        elif kind == "alltoall":  # each source's slice for this rank, in rank order
            result = np.concatenate([_slices(*contributions[r])[rank] for r in range(self.size)])
        else:
            root = contributions[0][0]
            result = np.array(contributions[root][1], copy=True)
        self._done[key] = self._done.get(key, 0) + 1
        if self._done[key] == self.size:
            del self._ops[key], self._done[key]
        return result, like


def _host(tensor):
    """A numpy copy, and the framework tensor to convert results back like (None for numpy)."""
    if isinstance(tensor, np.ndarray):
        return np.array(tensor, copy=True), None
    return np.array(ops_for(tensor).to_numpy(tensor), copy=True), tensor


def _slices(tensor, splits) -> list:
    """``tensor`` (1-d) cut into consecutive pieces of ``splits`` elements."""
    bounds = np.concatenate([[0], np.cumsum(np.asarray(splits, dtype=np.int64))])
    flat = np.reshape(tensor, -1)
    return [flat[bounds[j]:bounds[j + 1]] for j in range(len(bounds) - 1)]


class _InProcessWorker:
    def __init__(self, group: InProcessGroup, rank: int):
        self._group, self.rank, self.size = group, rank, group.size

    def allreduce_async(self, tensor, name):
        return self._group._contribute(("allreduce", name), self.rank, _host(tensor))

    def allgather_async(self, tensor, name):
        return self._group._contribute(("allgather", name), self.rank, _host(tensor))

    def broadcast_async(self, tensor, root, name):
        return self._group._contribute(("broadcast", name), self.rank, (root, *_host(tensor)))

    def alltoall_async(self, tensor, splits, name):
        data, like = _host(tensor)
        return self._group._contribute(("alltoall", name), self.rank,
                                       ((data, _host(splits)[0]), like))

    def synchronize(self, handle):
        return self._group._result(handle, self.rank)

    def hosts(self):
        """(this worker's host, the workers of its local rank on every host), for a group built
        with ``per_host``."""
        group = self._group
        if group.per_host is None:
            raise ValueError("InProcessGroup(size, per_host=k) simulates hosts of k workers; this "
                             "group was built without per_host")
        host, local = divmod(self.rank, group.per_host)
        return group._local[host].worker(local), group._cross[local].worker(host)


class MPICollectives:
    """``Collectives`` over mpi4py for numpy arrays (launched with ``mpirun``).

    Operations run when synchronized, so every worker must synchronize in the same order, which the
    ``grace`` pipeline does.
    """

    def __init__(self, comm: Any = None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self._comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()

    def allreduce_async(self, tensor, name):
        return ("allreduce", np.ascontiguousarray(tensor), None)

    def allgather_async(self, tensor, name):
        return ("allgather", np.ascontiguousarray(tensor).reshape(-1), None)

    def broadcast_async(self, tensor, root, name):
        return ("broadcast", np.ascontiguousarray(tensor), root)

    def alltoall_async(self, tensor, splits, name):
        return ("alltoall", np.ascontiguousarray(tensor).reshape(-1), np.asarray(splits))

    def synchronize(self, handle):
        kind, tensor, root = handle
        if kind == "allreduce":
            from mpi4py import MPI

            out = np.empty_like(tensor)
            self._comm.Allreduce(tensor, out, op=MPI.SUM)
            return out
        if kind == "allgather":
            return np.concatenate(self._comm.allgather(tensor))
        if kind == "alltoall":
            return np.concatenate(self._comm.alltoall(_slices(tensor, root)))
        return self._comm.bcast(tensor if self.rank == root else None, root=root)
