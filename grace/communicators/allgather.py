from __future__ import annotations

from grace.communicator import Communicator, Started
from grace.packing import pack_bytes, packed_bytes, unpack_bytes


class Allgather(Communicator):
    """Gathers every worker's payloads on every worker (Horovod allgather); each receiver
    decompresses them one by one and aggregates them. Valid for any compressor; the bytes each
    worker receives grow with the number of workers. A bucket's payloads travel as the bytes of one
    buffer per worker, headed by the int32 lengths of the parts whose size depends on the data (a
    threshold's) and the 4-byte non-finite flag."""

    name = "allgather"

    def start(self, payloads, varies, flag, tag, group, ops, entries=()):
        parts = [((i, j), t, vary) for i, (payload, vary) in enumerate(zip(payloads, varies))
                 for j, t in enumerate(payload)]
        buffer, layout = pack_bytes(parts, flag, ops)
        gather = group.allgather_async
        if not any(varies) and hasattr(group, "allgather_equal_async"):
            # Every worker's buffer is as long as this one: a collectives layer that would first
            # exchange the lengths (torch.distributed's) is told it need not.
            gather = group.allgather_equal_async
        return Started((gather(buffer, f"{tag}.gather"), layout,
                        [len(p) for p in payloads]), flag is not None, packed_bytes(parts, ops),
                       ops.nbytes(flag) if flag is not None else 0)

    def finish(self, started, group, ops):
        handle, layout, counts = started.handle
        workers, flag = unpack_bytes(group.synchronize(handle), layout, group.size, ops)
        started.bytes_received = sum(ops.nbytes(t) for r, parts in enumerate(workers)
                                     if r != group.rank for t in parts.values())
        return [[[parts[(i, j)] for j in range(n)] for parts in workers]
                for i, n in enumerate(counts)], flag
