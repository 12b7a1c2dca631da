"""The two-stage exchange: compressed shards all-to-all to their owners, re-encoded there, then
all-gathered (``communicator="alltoall"``)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from grace.communicator import Communicator, Started
from grace.communicators.allgather import Allgather
from grace.communicators.allreduce import Allreduce
from grace.compressor import Compressor, Context, Payload, Sparse, numel_of, zero_sent
from grace.memories.none import NoneMemory
from grace.memories.residual import ResidualMemory
from grace.memory import Memory
from grace.ops import Ops, Tensor, index_dtype, ops_for
from grace.packing import pack_bytes, packed_bytes, unpack_bytes


def shard_sizes(numel: int, shards: int) -> list[int]:
    """``numel`` elements cut into ``shards`` consecutive pieces whose sizes differ by at most one,
    the larger first (every worker cuts alike)."""
    base, extra = divmod(numel, shards)
    return [base + (1 if j < extra else 0) for j in range(shards)]


class ShardCodec(Compressor):
    """A compressor applied shard by shard: the flattened tensor cut into one shard per worker
    (``shard_sizes``), each encoded by ``inner`` on its own (its state keyed ``name/j``). Its
    payload is the shards' payloads one after another; decoding, the residual and the memories see
    one tensor, so any memory works unchanged on the worker's side.

    At shard ``r``'s owner (worker ``r``), ``reencode`` combines every worker's payload of that
    shard as ``inner`` aggregates (a sum; a majority vote for signSGD and signum), adds the owner's
    own residual (``owner_memory``: error feedback at the owner, keyed ``name@owner``), and encodes
    the result again with ``inner.owner_codec()``; ``aggregate_payloads`` decodes the owners'
    payloads, one per shard, into the whole tensor."""

    def __init__(self, inner: Compressor, shards: int, owner_memory: Memory):
        self.inner = inner
        self.owner = inner.owner_codec()
        self.shards = shards
        self.owner_memory = owner_memory
        self.name = inner.name
        self.fixed_size = inner.fixed_size
        self.agrees_on_form = inner.agrees_on_form
        self.state_store = inner.state_store

    def state(self) -> dict[str, dict]:
        return {}  # the inner compressor's and the owner memory's state are saved with theirs

    def _contexts(self, numel: int, ctx: Context) -> list[Context]:
        return [Context((m,), ctx.dtype, m, rank=ctx.rank) for m in shard_sizes(numel, self.shards)]

    def compress(self, tensor, name, ops=None, rank=0):
        ops = ops or ops_for(tensor)
        ctx = Context(ops.shape(tensor), ops.dtype(tensor), ops.numel(tensor), rank=rank)
        payload: Payload = []
        shards = []
        for j, piece in enumerate(ops.split(ops.flatten(tensor), shard_sizes(ctx.numel, self.shards))):
            part, shard_ctx = self.inner.compress(piece, f"{name}/{j}", ops, rank=rank)
            payload += part
            shards.append(shard_ctx)
        ctx.data.update(shards=shards, parts=len(payload) // self.shards, name=name)
        return payload, ctx

    def shard_payloads(self, payload: Payload, ctx: Context) -> list[Payload]:
        """``payload`` cut into its shards' payloads."""
        p = ctx.data["parts"]
        return [list(payload[j * p:(j + 1) * p]) for j in range(self.shards)]

    def compress_flat(self, flat, name, ctx, ops):  # compress() does the work, shard by shard
        raise NotImplementedError

    def decompress_flat(self, payload, ctx, ops):
        pieces = [ops.flatten(self.inner.decompress(p, c, ops))
                  for p, c in zip(self.shard_payloads(payload, ctx), ctx.data["shards"])]
        return ops.concat(pieces)

    def _shifted(self, positions: Tensor, j: int, ctx: Context, ops: Ops) -> Tensor:
        """Positions within shard ``j`` as positions within the whole tensor."""
        positions = ops.cast(positions, index_dtype(ctx.numel))
        start = sum(shard_sizes(ctx.numel, self.shards)[:j])
        if not start:
            return positions
        return ops.add(positions, ops.constant([start], ops.dtype(positions), like=positions))

    def sent_indices(self, payload, ctx):
        """The shards' sent entries, as positions in the whole tensor (so that the residual is one
        fill of the compensated tensor, and DGC's masking finds them)."""
        found = [self.inner.sent_indices(p, c)
                 for p, c in zip(self.shard_payloads(payload, ctx), ctx.data["shards"])]
        if any(f is None for f in found):
            return None
        ops = ops_for(found[0])
        return ops.concat([self._shifted(f, j, ctx, ops) for j, f in enumerate(found)])

    def residual(self, compensated, payload, ctx, ops, overwrite=False):
        # Where every shard sent its entries as they are, one fill of the whole tensor; else
        # each shard's residual is left to the inner codec.
        sent = self.sent_indices(payload, ctx)
        if sent is not None:
            return zero_sent(compensated, sent, payload, ctx, ops, overwrite)
        pieces = ops.split(ops.flatten(compensated), shard_sizes(ctx.numel, self.shards))
        left = [ops.flatten(self.inner.residual(piece, p, c, ops, overwrite))
                for piece, p, c in zip(pieces, self.shard_payloads(payload, ctx), ctx.data["shards"])]
        return ops.reshape(ops.concat(left), ctx.shape)

    def not_smaller(self, flat, ctx, ops):
        votes = [self.inner.not_smaller(piece, c, ops)
                 for piece, c in zip(ops.split(flat, shard_sizes(ctx.numel, self.shards)),
                                     self._contexts(ctx.numel, ctx))]
        vote = votes[0]
        for other in votes[1:]:
            vote = ops.maximum(vote, other)
        return vote

    def payload_nbytes(self, shape, itemsize):
        sizes = [self.inner.payload_nbytes((m,), itemsize)
                 for m in shard_sizes(numel_of(shape), self.shards)]
        return None if any(s is None for s in sizes) else sum(sizes)

    def reencode(self, received: Sequence[Payload], ctx: Context, ops: Ops) -> Payload:
        """At this worker, the owner of shard ``ctx.rank``: every worker's payload of that shard
        (``received``, in rank order) combined, plus the owner's residual, encoded again."""
        shard_ctx = ctx.data["shards"][ctx.rank]
        name = f"{ctx.data['name']}@owner"
        total = self.inner.aggregate_payloads(list(received), shard_ctx, ops)
        total = self.owner_memory.compensate(total, name, ops)
        payload, owner_ctx = self.owner.compress(total, name, ops, rank=ctx.rank)
        self.owner_memory.update(total, name, self.owner, payload, owner_ctx, ops)
        return payload

    def aggregate_payloads(self, payloads, ctx, ops, scale=1.0):
        """The owners' re-encoded shards (``payloads``: one, the shards' one after another) as the
        whole tensor, times ``scale``."""
        (payload,) = payloads
        p = len(payload) // self.shards
        shards = [payload[j * p:(j + 1) * p] for j in range(self.shards)]
        contexts = self._contexts(ctx.numel, ctx)
        owner = self.owner
        if isinstance(owner, Sparse):  # every shard's entries scattered at once
            shifted = [owner.with_positions(s, self._shifted(owner.positions(s, c), j, ctx, ops))
                       for j, (s, c) in enumerate(zip(shards, contexts))]
            return owner.aggregate_payloads(shifted, ctx, ops, scale)
        # Each shard decoded and scaled by the owner's codec (a sparsifier scales its few values,
        # not the tensor), then joined.
        pieces = [ops.flatten(owner.aggregate_payloads([s], c, ops, scale)) for s, c in zip(shards, contexts)]
        return ops.reshape(ops.concat(pieces), ctx.shape)

    def __repr__(self):
        return f"ShardCodec({self.inner!r}, shards={self.shards})"


class Alltoall(Communicator):
    """The two-stage exchange whose bytes per worker stay flat as workers are added, for any
    compressor that can encode a shard (CGX, Markov et al. 2022; DeepSpeed's compressed allreduce
    for 1-bit Adam, Tang et al. 2021; GRACE's AllToAll). Each worker cuts a tensor's compensated
    gradient into n shards and encodes each (``ShardCodec``); shard j of every worker goes to worker
    j (one Horovod alltoall per bucket, the payloads packed as bytes with their lengths and the
    non-finite flag); each owner decodes its n contributions, combines them as the algorithm does,
    adds its own residual (error feedback at the owner, where the pipeline keeps one on the
    worker's side too), re-encodes, and the re-encoded shards are all-gathered (one allgather per
    bucket). A worker sends and receives about ``(1 + s) (n-1)/n`` of one compressed copy, where
    ``allgather`` receives ``n-1`` copies; ``s`` is the owners' share (``owner_share``): 1 where
    an owner encodes as the workers do, 2 for top-k's owners (they keep twice the workers' share),
    for 1-bit's (two passes) and for a sign vote's 2-bit codes.

    Not for a compressor of several rounds (PowerSGD) or with summable payloads (random-k, fp16,
    none): their allreduce is already flat in n."""

    name = "alltoall"
    shards = True  # the pipeline encodes with a ShardCodec for it
    _caution: str | None = None

    def bind(self, compressor, memory=None):
        if compressor.rounds > 1 or compressor.summable:
            raise ValueError(
                f"communicator='alltoall' re-encodes each shard at its owner, for payloads that "
                f"cannot be added up; {compressor.name!r} payloads are summed by an allreduce, whose "
                f"bytes per worker already stay flat as workers are added: use "
                f"communicator='allreduce'")
        self._caution = compressor.owners_caution

    def notice(self, size: int, compressor: str) -> str | None:
        """Named by the user for a compressor measured short through the owners: why, and what
        gathers instead."""
        if self._caution is None:
            return None
        return (f"grace: {compressor} through the shards' owners (communicator='alltoall'): "
                f"{self._caution}; communicator='auto' or 'allgather' gathers its payloads instead")

    def start(self, payloads, varies, flag, tag, group, ops, entries=()):
        n, rank = group.size, group.rank
        shard_parts = [len(p) // n for p in payloads]
        buffers, layouts, sent = [], [], 0
        for j in range(n):
            parts = [((i, k), payload[j * p + k], vary) for i, (payload, p, vary)
                     in enumerate(zip(payloads, shard_parts, varies)) for k in range(p)]
            buffer, layout = pack_bytes(parts, flag, ops)
            buffers.append(buffer)
            layouts.append(layout)
            if j != rank:  # a worker's own shard stays with it
                sent = sent + packed_bytes(parts, ops)
        handle = group.alltoall_async(ops.concat(buffers), ops.lengths(buffers), f"{tag}.shards")
        control = 4 * (n - 1) if flag is not None else 0
        return Started((handle, layouts[rank], shard_parts, list(entries), tag), flag is not None,
                       sent, control)

    def relay(self, started, group, ops):
        handle, layout, shard_parts, entries, tag = started.handle
        if isinstance(handle, _Relayed):
            return
        n = group.size
        contributions, flag = unpack_bytes(group.synchronize(handle), layout, n, ops)
        started.bytes_received = _bytes_from_others(contributions, group.rank, ops)
        owned = []
        for i, (entry, p) in enumerate(zip(entries, shard_parts)):
            received = [[parts[(i, k)] for k in range(p)] for parts in contributions]
            with entry.compressor.state_store.within(entry.transaction):
                owned.append(entry.compressor.reencode(received, entry.ctx, ops))
        parts = [((i, k), t, True) for i, payload in enumerate(owned) for k, t in enumerate(payload)]
        buffer, layout = pack_bytes(parts, None, ops)
        started.bytes_later = packed_bytes(parts, ops)
        gathering = group.allgather_async(buffer, f"{tag}.owners")
        started.handle = (_Relayed(gathering, flag), layout, [len(p) for p in owned], entries, tag)

    def finish(self, started, group, ops):
        self.relay(started, group, ops)
        relayed, layout, owned_parts, _, _ = started.handle
        gathered, _ = unpack_bytes(group.synchronize(relayed.handle), layout, group.size, ops)
        started.bytes_received = started.bytes_received + _bytes_from_others(gathered, group.rank, ops)
        results = []
        for i, count in enumerate(owned_parts):
            whole: list[Tensor] = []
            for by_owner in gathered:
                whole += [by_owner[(i, k)] for k in range(count)]
            results.append([whole])
        return results, relayed.flag


class _Relayed:
    """The second stage in flight, and the first stage's flag summed over workers."""

    def __init__(self, handle: Any, flag: Any):
        self.handle, self.flag = handle, flag


def _bytes_from_others(per_worker: list[dict], rank: int, ops: Ops) -> Any:
    """The payload bytes that came from the other workers (a worker's own part never travels)."""
    return sum(ops.nbytes(t) for r, parts in enumerate(per_worker) if r != rank for t in parts.values())


ALLTOALL_FROM = 5
"""The job size from which ``communicator="auto"`` exchanges through the shards' owners. The cost
model (``scripts/tools/cost_model.py``, docs/results.md) puts the crossover, where the two stages' bytes
``(1 + s) (n-1)/n`` beat gathering's ``n-1`` payloads once the second collective's latency and the
owners' decode and re-encode are paid, at 3 to 5 workers for every compressor at 1 to 100 Gbit/s
(1-bit, whose owners send two passes, at 4; top-k, whose owners keep twice the workers' share,
at 5, and 6 at 100 Gbit/s); past 4 the two stages move at most 2/5 of gathering's bytes (3/5 for
top-k and 1-bit). Up to 4, where they would save at most half, gathering keeps its one collective
and its one encoding (no second rounding at an owner)."""


def owner_share(compressor: Compressor) -> float:
    """What an owner sends on of its shard over what a worker sent into it, in bytes: 1 where the
    owner encodes as the workers do, 2 for top-k's owners (``OWNERS_KEEP``), for 1-bit's
    (``OWNER_BITS``) and for a sign vote's 2-bit codes. A worker moves ``(1 + share) (n-1)/n`` of
    one payload through the owners (the cost model's input; taken on a shard of 2**20 float32
    elements)."""
    shard = (1 << 20,)
    own, owner = (c.payload_nbytes(shard, 4) for c in (compressor, compressor.owner_codec()))
    return 1.0 if not own or owner is None else owner / own


def keeps_residual(memory: Memory | None) -> bool:
    """Whether the workers keep error feedback, and so the owners keep a residual of their own."""
    return memory is not None and not isinstance(memory, NoneMemory)


def owners_keep_it(compressor: Compressor, memory: Memory | None) -> bool:
    """Whether the owner's second encoding loses nothing for good: error feedback keeps what it
    rounds away (the pipeline has a memory, so the owner keeps a residual too), or the owner's
    codec carries the combination exactly (signSGD's votes). An unbiased quantizer without memory
    (QSGD, TernGrad, natural) adds a second rounding's noise that nothing takes back, and error
    feedback on a stochastic rounding whose variance exceeds the value diverges (measured,
    tests/test_alltoall.py, docs/user-guide.md)."""
    return keeps_residual(memory) or compressor.owner_codec().sends_exactly


class Sharding:
    """The codecs of the shard owners' route, for the pipeline: one ``ShardCodec`` per size of
    group the compressor is exchanged among (built at first use and given the pipeline's state
    store by ``own``), all sharing the owners' error feedback (``owner_memory``: a residual where
    the workers keep one, ``keeps_residual``, else none). A tensor with fewer elements than
    workers, or a group of one, is not cut: it is gathered as it is (``gathered``)."""

    def __init__(self, compressor: Compressor, memory: Memory, communicator: Communicator,
                 gathered: Communicator, own: Callable[..., None]):
        self.compressor = compressor
        self.gathered = gathered
        self.owner_memory: Memory = (ResidualMemory() if communicator.shards and keeps_residual(memory)
                                     else NoneMemory())
        self._codecs: dict[int, ShardCodec] = {}
        self._own = own

    def parts(self, numel: int, communicator: Communicator, size: int
              ) -> tuple[Compressor, Communicator]:
        """The codec and communicator of a tensor of ``numel`` elements among ``size`` workers."""
        if size < 2 or numel < size:
            return self.compressor, self.gathered
        codec = self._codecs.get(size)
        if codec is None:
            codec = self._codecs[size] = ShardCodec(self.compressor, size, self.owner_memory)
            self._own(codec, codec.owner)
        return codec, communicator


class Auto(Communicator):
    """The communicator chosen by the job's size (the default of every compressor whose payloads
    are gathered): ``allgather`` up to ``ALLTOALL_FROM - 1`` workers, ``alltoall`` from
    ``ALLTOALL_FROM`` on, so that the bytes per worker stay flat on large jobs, where the owners'
    second encoding loses nothing for good (``owners_keep_it``) and is not measured to cost
    accuracy (``Compressor.owners_caution``), else ``allgather`` at any size;
    ``allreduce`` for a compressor whose payloads add up (already flat). Decided per process set,
    when the exchange starts."""

    name = "auto"
    shards = True  # it may: the pipeline keeps an owner's memory ready

    def __init__(self, alltoall_from: int = ALLTOALL_FROM):
        self.alltoall_from = alltoall_from
        self._gather, self._through_owners = Allgather(), Alltoall()
        self._sum = Allreduce()
        self._summed = False
        self._owners = True

    def bind(self, compressor, memory=None):
        self._summed = compressor.summable or compressor.rounds > 1
        if self._summed:
            self._sum.bind(compressor)
        self._owners = owners_keep_it(compressor, memory) and compressor.owners_caution is None

    def resolve(self, size: int) -> Communicator:
        if self._summed:
            return self._sum
        return self._through_owners if self._owners and size >= self.alltoall_from else self._gather

    def start(self, payloads, varies, flag, tag, group, ops, entries=()):
        return self.resolve(group.size).start(payloads, varies, flag, tag, group, ops, entries)

    def finish(self, started, group, ops):
        return self.resolve(group.size).finish(started, group, ops)

    def notice(self, size: int, compressor: str) -> str | None:
        if self.resolve(size) is not self._through_owners:
            return None
        return (f"grace: communicator='auto' sends {compressor}'s payloads through the shards' "
                f"owners at {size} workers (from {self.alltoall_from} on), which encode each "
                f"shard's sum a second time: the bytes per worker stay flat, at the cost of that "
                f"second lossy encoding (docs/user-guide.md, 'Large jobs'); "
                f"communicator='allgather' keeps gathering")

    def __repr__(self):
        return f"Auto(alltoall_from={self.alltoall_from})"
