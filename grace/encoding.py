"""A bucket's entries made ready to send, one step at a time: the way each takes this step, error
feedback around the codec, and the workers' vote on the form of a payload whose size depends on
the data."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, Callable

from grace.collectives import Collectives
from grace.communicator import Communicator
from grace.communicators.allreduce import Allreduce
from grace.communicators.alltoall import Sharding
from grace.compressor import Compressor, Context
from grace.compressors.none import NoneCompressor
from grace.exchange import Entry
from grace.memory import Memory
from grace.ops import Ops, Tensor
from grace.plan import Plan, Route
from grace.rounds import Rounds
from grace.state import StateStore
from grace.takeover import Takeover
from grace.transaction import StepTransaction, carries_nonfinite
from grace.warmup import Warmup


def takes_overwrite(memory: Memory) -> bool:
    """Whether ``memory.compensate`` takes ``overwrite`` (a memory written before it was, with
    ``compensate(tensor, name, ops)``, keeps working: it is called as it was written)."""
    kind = type(memory)
    if kind not in _TAKES_OVERWRITE:
        _TAKES_OVERWRITE[kind] = "overwrite" in inspect.signature(kind.compensate).parameters
    return _TAKES_OVERWRITE[kind]


_TAKES_OVERWRITE: dict[type, bool] = {}


class Encoding:
    """Each entry of a bucket (a tensor, or tensors joined) encoded for this step, in the order
    error feedback requires (Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al.,
    "Error Feedback Fixes SignSGD", ICML 2019): ``memory.compensate`` adds the residual kept from
    the last step, ``compressor.compress`` encodes the sum, ``memory.update`` keeps what the
    encoding lost. First the entry's way this step: empty (nothing travels), dense (allreduce,
    with the momentum taken over as its only memory) or compressed (through the shard owners'
    codec where the communicator shards), the warm-up's count deciding while it lasts. Every
    write is pending in the entry's transaction until the step's verdict.

    A compressor whose encoded size depends on the data (``agrees_on_form``: thresholds, adaptive
    codes) first asks the workers, by one allreduce of a 4-byte vote per entry for the whole
    bucket, whether every one sends the entry encoded or all send it dense: deciding alone, a
    worker would have to say which form it sent, in bytes beyond the dense tensor's.

    In a traced graph (``tf.function``) the warm-up's count and the vote are tensors known only
    when the graph runs: both ways are built, each with its own writes, and the one chosen runs
    its whole exchange once the step's verdict is known (``Entry.deferred``)."""

    def __init__(self, compressor: Compressor, memory: Memory, communicator: Communicator,
                 planner: Plan, takeover: Takeover, warmup: Warmup, sharding: Sharding,
                 rounds: Rounds, transaction: StepTransaction, state_store: StateStore,
                 counters: dict, check_finite: bool):
        self.compressor, self.memory, self.communicator = compressor, memory, communicator
        self.planner, self.takeover, self.warmup, self.sharding = planner, takeover, warmup, sharding
        self.rounds, self.transaction = rounds, transaction
        self.state_store, self._counters = state_store, counters
        self.check_finite = check_finite
        self.dense_compressor = NoneCompressor()
        self.dense_communicator = Allreduce()

    @property
    def dense_memory(self) -> Memory:
        """The memory of the entries that travel dense: the momentum taken over, if any."""
        return self.takeover.dense_memory

    def prepare(self, entry: Entry, group: Collectives, ops: Ops) -> None:
        """Decide how ``entry`` travels this step and encode it (a vote first, for a compressor
        that ``agrees_on_form``; in a traced graph the warm-up's choice is deferred)."""
        shape, dtype = ops.shape(entry.source), ops.dtype(entry.source)
        route = entry.route or self.planner.route(shape, dtype, ops)
        if route == Route.EMPTY:
            entry.ready = ops.copy(entry.source)
            return
        dense, count = route == Route.DENSE, False
        if not dense and self.warmup.steps:
            # Read here; counted with the step's other state writes, so a skipped step undoes it.
            exchange = self.warmup.exchanges_of(entry.name, ops)
            if not isinstance(exchange, int):
                entry.flagged = self.check_finite
                entry.deferred = self._traced_warmup(entry, exchange, group, ops)
                return
            dense, count = self.warmup.dense_now(exchange), True
        self._route(entry, dense, count, group, ops)

    def _route(self, entry: Entry, dense: bool, count: bool, group: Collectives, ops: Ops) -> None:
        """Compensate ``entry`` and encode it dense or compressed, its state writes pending in its
        transaction; ``count``: count the exchange for the warm-up."""
        if dense:
            entry.compressor, entry.memory, entry.communicator = (
                self.dense_compressor, self.dense_memory, self.dense_communicator)
        else:
            entry.compressor, entry.memory, entry.communicator = (
                self.compressor, self.memory, self.communicator.resolve(group.size))
            if entry.communicator.shards:
                entry.compressor, entry.communicator = self.sharding.parts(
                    ops.numel(entry.source), entry.communicator, group.size)
        carries = carries_nonfinite(entry.compressor, entry.memory, entry.communicator)
        if self.check_finite and (count or not carries):
            entry.transaction = {}
            entry.flagged = not carries
        source = entry.source
        if entry.owned and entry.flagged:  # read before error feedback writes into the source
            entry.flag = ops.nonfinite_flag(source)
        with self.state_store.within(entry.transaction):
            if count:
                self.warmup.count(entry.name, ops)
            # A lent tensor is not one to keep: a residual computed in it would be the caller's
            # again after the step (DDP writes the result, then the next gradient, into it).
            if entry.owned and not entry.lent and takes_overwrite(entry.memory):
                entry.compensated = entry.memory.compensate(source, entry.name, ops, overwrite=True)
            else:  # as a Memory written before ``overwrite`` was is called: three arguments
                entry.compensated = entry.memory.compensate(source, entry.name, ops)
        self.state_store.counter(ops, self._counters, "bytes_dense",
                                 ops.numel(source) * ops.itemsize(ops.dtype(source)))
        self.state_store.counter(ops, self._counters, "tensors", len(entry.positions))
        entry.ctx = Context(ops.shape(source), ops.dtype(source), ops.numel(source), rank=group.rank)
        if not dense and entry.compressor.agrees_on_form:
            entry.vote = entry.compressor.not_smaller(ops.flatten(entry.compensated), entry.ctx, ops)
        else:
            self._encode(entry, group, ops)

    def _encode(self, entry: Entry, group: Collectives, ops: Ops) -> None:
        with self.state_store.within(entry.transaction):
            entry.payload, entry.ctx = entry.compressor.compress(entry.compensated, entry.name, ops,
                                                                 rank=group.rank)
            if entry.compressor.rounds == 1:
                entry.memory.update(entry.compensated, entry.name, entry.compressor, entry.payload,
                                    entry.ctx, ops)

    def vote(self, entries: list[Entry], tag: str, group: Collectives, ops: Ops) -> None:
        """The workers agree on the form of every entry that voted (``agrees_on_form``): encoded
        by every one of them (each, lengths included, smaller than the tensor) or dense through
        allreduce (exactly the dense bytes). Each vote came from the tensor before it was encoded
        (``Compressor.not_smaller``), so a dense step encodes nothing."""
        voting = [e for e in entries if e.vote is not None]
        if not voting:
            return
        votes = ops.concat([e.vote for e in voting]) if len(voting) > 1 else voting[0].vote
        self.state_store.counter(ops, self._counters, "bytes_control", ops.nbytes(votes))
        agreed = group.synchronize(group.allreduce_async(votes, f"{tag}.form"))
        pieces = ops.split(agreed, [1] * len(voting)) if len(voting) > 1 else [agreed]
        for entry, piece in zip(voting, pieces):
            entry.vote = None
            dense = ops.is_set(piece)
            if isinstance(dense, bool):
                if dense:
                    entry.compressor, entry.communicator = self.dense_compressor, self.dense_communicator
                self._encode(entry, group, ops)
            else:  # a traced graph: the agreement is known when it runs
                entry.deferred = self._traced_agreement(entry, dense, group, ops)

    def _traced_agreement(self, entry: Entry, dense: Any, group: Collectives, ops: Ops) -> Callable:
        def deferred(discard, scale):
            def run(dense_way: bool):
                branch = replace(entry, transaction=None if entry.transaction is None
                                 else dict(entry.transaction))  # each branch its own writes
                if dense_way:
                    branch.compressor, branch.communicator = (self.dense_compressor,
                                                              self.dense_communicator)
                self._encode(branch, group, ops)
                return self._exchange_now(branch, group, ops, scale, discard)
            return ops.cond(dense, lambda: run(True), lambda: run(False))
        return deferred

    def _traced_warmup(self, entry: Entry, exchange: Any, group: Collectives, ops: Ops) -> Callable:
        """In a traced graph the exchange count is only known when the graph runs (``Warmup.traced``).
        The state written inside a way must be committed there, so the way runs once the step's
        verdict is known (``Pipeline.finish_step``)."""
        def deferred(discard, scale):
            def way(dense: bool):
                branch = Entry(entry.name, entry.positions, entry.shapes, entry.source)
                self._route(branch, dense, False, group, ops)
                self.vote([branch], f"grace.{entry.name}", group, ops)
                if branch.deferred is not None:
                    return branch.deferred(discard, scale)
                return self._exchange_now(branch, group, ops, scale, discard)
            return self.warmup.traced(entry.name, exchange, way, self.check_finite, discard, ops)
        return deferred

    def _exchange_now(self, entry: Entry, group: Collectives, ops: Ops, scale: float,
                      discard: Tensor) -> Tensor:
        """One encoded entry's whole exchange, its writes committed unless ``discard``."""
        sent = self.rounds.send([entry], f"grace.{entry.name}", group, ops, None)
        total = self.rounds.collect([entry], sent, f"grace.{entry.name}", group, ops, scale)[0][0]
        return self.transaction.settle(entry, total, discard, ops)
