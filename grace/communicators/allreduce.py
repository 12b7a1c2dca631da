from __future__ import annotations

from grace.collectives import sums_fused
from grace.communicator import Communicator, Started
from grace.packing import pack_sums, unpack_sums

ALONE_FROM = 1 << 20
"""Where the collectives fuse sums themselves (``sums_fused``), a payload part of this many bytes
or more is allreduced on its own, as soon as it exists; the smaller ones stay joined per bucket
(top-k's dense biases, a few KB: one op each cost TensorFlow's ResNet-50 step 20-40 ms)."""


class Allreduce(Communicator):
    """Sums the payloads over the workers (Horovod allreduce), so the receiver decompresses once.
    A bucket's payloads travel joined, one allreduce per dtype, with the non-finite flag as one
    more element (a large one on its own where the collectives fuse sums themselves: ``ALONE_FROM``).
    Bytes per worker do not grow with the number of workers, but it is only valid when every
    worker's payload has the same layout (a ``summable`` compressor: none, fp16, random-k with a
    shared seed)."""

    name = "allreduce"
    sums = True

    def bind(self, compressor, memory=None):
        if not compressor.summable:
            raise ValueError(
                f"communicator='allreduce' cannot carry {compressor.name!r} payloads: each worker's "
                f"payload has its own layout (e.g. its own indices), so an element-wise sum would be "
                f"wrong. Use communicator='allgather' (or 'broadcast')."
            )

    def start(self, payloads, varies, flag, tag, group, ops, entries=()):
        parts = [((i, j), t) for i, payload in enumerate(payloads) for j, t in enumerate(payload)]
        buffers, layout = pack_sums(parts, flag, ops, ALONE_FROM if sums_fused(group) else None)
        given = getattr(group, "allreduce_given_async", None)
        handles = [(given if given is not None and _given_over(layout, k, b, entries, ops) else
                    group.allreduce_async)(b, f"{tag}.sum{k}") for k, b in enumerate(buffers)]
        control = ops.itemsize(layout.flag_dtype) if flag is not None else 0  # 2 bytes in float16
        return Started((handles, layout, [len(p) for p in payloads]), flag is not None,
                       sum(ops.nbytes(t) for _, t in parts), control)

    def finish(self, started, group, ops):
        handles, layout, counts = started.handle
        parts, flag = unpack_sums([group.synchronize(h) for h in handles], layout, ops)
        started.bytes_received = started.bytes_sent  # the sum, as large as what went in
        return [[[parts[(i, j)] for j in range(n)]] for i, n in enumerate(counts)], flag


def _given_over(layout, k: int, buffer, entries, ops) -> bool:
    """Whether ``buffer`` (the ``k``-th) may be summed in place: joined by ``pack_sums``, or the
    lone payload of an entry whose source is given over (``Entry.source_given_over``: the
    caller's, with no state keeping it), encoded by an element-wise codec (its payload is that
    source, or a cast of it), so that
    nothing reads it after it is sent, and a tensor that may be written at all (``Ops.writable``:
    not one autograd tracks)."""
    if layout.made[k]:
        return True
    members = layout.buffers[k][1]
    if len(members) != 1 or members[0][0][0] >= len(entries):
        return False
    entry = entries[members[0][0][0]]
    return entry.source_given_over and entry.compressor.elementwise and ops.writable(buffer)
