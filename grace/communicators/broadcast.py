from __future__ import annotations

from grace.communicator import Communicator


class Broadcast(Communicator):
    """Each worker in turn broadcasts its payload to all others (one Horovod broadcast per worker and
    payload tensor), the scheme GRACE offers for MPI set-ups without a variable-size allgather. The
    result equals ``allgather``'s; it needs payloads whose size is known in advance."""

    name = "broadcast"

    def bind(self, compressor):
        if not compressor.fixed_size:
            raise ValueError(
                f"communicator='broadcast' needs payloads of a size known in advance, and "
                f"{compressor.name!r} payloads vary; use communicator='allgather'."
            )

    def start(self, payload, name, group, ops):
        handles = []
        for root in range(group.size):
            sent = payload if root == group.rank else [
                ops.zeros(ops.numel(t), ops.dtype(t), like=t) for t in payload
            ]
            handles.append(
                [group.broadcast_async(t, root, f"{name}.{i}.from{root}") for i, t in enumerate(sent)]
            )
        return handles

    def finish(self, handle, group, ops):
        return [[group.synchronize(h) for h in per_root] for per_root in handle]

    def bytes_sent(self, payload, group, ops):
        # One broadcast per worker: this worker's payload as root, and a tensor of the same size
        # into each of the others' (Horovod's receive buffer).
        return sum(ops.nbytes(t) for t in payload) * group.size
