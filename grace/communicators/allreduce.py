from __future__ import annotations

from grace.communicator import Communicator


class Allreduce(Communicator):
    """Sums each payload tensor over the workers (Horovod allreduce), so the receiver decompresses
    once. Bytes per worker do not grow with the number of workers, but it is only valid when every
    worker's payload has the same layout (a ``summable`` compressor: none, fp16, random-k with a
    shared seed)."""

    name = "allreduce"

    def bind(self, compressor):
        if not compressor.summable:
            raise ValueError(
                f"communicator='allreduce' cannot carry {compressor.name!r} payloads: each worker's "
                f"payload has its own layout (e.g. its own indices), so an element-wise sum would be "
                f"wrong. Use communicator='allgather' (or 'broadcast')."
            )

    def start(self, payload, name, group, ops):
        return [group.allreduce_async(t, f"{name}.{i}") for i, t in enumerate(payload)]

    def finish(self, handle, group, ops):
        return [[group.synchronize(h) for h in handle]]

    def bytes_sent(self, payload, group, ops):
        return sum(ops.nbytes(t) for t in payload)
