from __future__ import annotations

from grace.communicator import Communicator, Started


class Broadcast(Communicator):
    """Each worker in turn broadcasts its payload to all others (one Horovod broadcast per worker and
    payload tensor), the scheme GRACE offers for MPI set-ups without a variable-size allgather. The
    result equals ``allgather``'s; it needs payloads whose size is known in advance, and the
    non-finite flag travels in an allreduce of its own."""

    name = "broadcast"

    def bind(self, compressor, memory=None):
        if not compressor.fixed_size:
            raise ValueError(
                f"communicator='broadcast' needs payloads of a size known in advance, and "
                f"{compressor.name!r} payloads vary; use communicator='allgather'."
            )

    def start(self, payloads, varies, flag, tag, group, ops, entries=()):
        handles = []
        for i, payload in enumerate(payloads):
            per_root = []
            for root in range(group.size):
                sent = payload if root == group.rank else [
                    ops.zeros(ops.numel(t), ops.dtype(t), like=t) for t in payload]
                per_root.append([group.broadcast_async(t, root, f"{tag}.{i}.{j}.from{root}")
                                 for j, t in enumerate(sent)])
            handles.append(per_root)
        # One broadcast per worker: this worker's payload as root, and a tensor of the same size
        # into each of the others' (Horovod's receive buffer).
        sent_bytes = sum(ops.nbytes(t) for payload in payloads for t in payload) * group.size
        return Started(handles, False, sent_bytes)

    def finish(self, started, group, ops):
        received = [[[group.synchronize(h) for h in per_root] for per_root in payload]
                    for payload in started.handle]
        started.bytes_received = sum(ops.nbytes(t) for payload in received
                                     for root, parts in enumerate(payload) if root != group.rank
                                     for t in parts)
        return received, None
