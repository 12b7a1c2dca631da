from __future__ import annotations

from grace.communicator import Communicator
from grace.compressor import LENGTH_BYTES


class Allgather(Communicator):
    """Gathers every worker's payload on every worker (Horovod allgather); each receiver decompresses
    the payloads one by one and aggregates them. Valid for any compressor; the bytes each worker
    receives grow with the number of workers. When a compressor's payload size varies (e.g. a
    threshold), the lengths travel too, as one small int32 tensor."""

    name = "allgather"

    def bind(self, compressor):
        self._fixed_size = compressor.fixed_size

    def start(self, payload, name, group, ops):
        handles = [group.allgather_async(t, f"{name}.{i}") for i, t in enumerate(payload)]
        lengths = None
        if not self._fixed_size:
            lengths = group.allgather_async(ops.lengths(payload), f"{name}.lengths")
        return handles, lengths, [ops.size(t) for t in payload]

    def finish(self, handle, group, ops):
        handles, lengths, own_sizes = handle
        parts = len(own_sizes)
        gathered = [group.synchronize(h) for h in handles]
        if lengths is None:  # every worker's payload has this worker's sizes
            per_worker = [[n] * group.size for n in own_sizes]
        else:  # row r of the gathered table holds worker r's lengths
            table = group.synchronize(lengths)
            per_worker = [ops.gather(table, ops.constant([r * parts + i for r in range(group.size)],
                                                         "int32", like=table))
                          for i in range(parts)]
        pieces = [ops.split(g, sizes) for g, sizes in zip(gathered, per_worker)]
        return [[pieces[i][r] for i in range(parts)] for r in range(group.size)]

    def bytes_sent(self, payload, group, ops):
        header = 0 if self._fixed_size else LENGTH_BYTES * len(payload)
        return sum(ops.nbytes(t) for t in payload) + header
