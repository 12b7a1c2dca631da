"""A sparse gradient's rows started on their exchange (``Pipeline.start_sparse``): the route of
``grace.sparse``'s parts for one table."""

from __future__ import annotations

from typing import Callable

from grace.collectives import Collectives
from grace.communicator import Communicator
from grace.communicators.allgather import Allgather
from grace.compressor import Compressor, numel_of
from grace.exchange import Entry, Exchange
from grace.memories.none import NoneMemory
from grace.memory import Memory
from grace.ops import Ops
from grace.plan import Plan, Route
from grace.rounds import Rounds
from grace.sparse import RowResidual, Rows, RowsCodec, payload_bytes_horovod
from grace.state import StateStore
from grace.takeover import Takeover
from grace.transaction import flag_of
from grace.warmup import Warmup


class RowExchange:
    """A sparse gradient exchanged as rows, as Horovod gathers an embedding's gradient but smaller
    (``grace.sparse``): each worker adds up the rows of repeated indices, adds the residual rows
    error feedback kept (``RowResidual``: the rows touched, never the table), encodes the rows
    with the pipeline's compressor where it would compress the table (``Plan``) and can encode
    rows (``Compressor.encodes_rows``), else sends them as they are, and gathers every worker's
    indices and rows in one collective with the non-finite flag (``communicator``). The warm-up
    sends rows unencoded while it lasts (eagerly; a traced graph has no warm-up for rows), and a
    momentum taken over from the optimizer is applied to the rows after the exchange
    (``RowVelocity``).

    The exchange ends as every other (``Pipeline.finish_step``); its result is the rows combined
    over the workers, one per distinct index, as ``Rows``."""

    def __init__(self, compressor: Compressor, memory: Memory, planner: Plan, takeover: Takeover,
                 warmup: Warmup, rounds: Rounds, state_store: StateStore, counters: dict,
                 check_finite: bool, own: Callable[..., None]):
        self.compressor, self.memory, self.planner = compressor, memory, planner
        self.takeover, self.warmup, self.rounds = takeover, warmup, rounds
        self.state_store, self._counters = state_store, counters
        self.check_finite = check_finite
        self._own = own
        self.residual = RowResidual()
        self.communicator: Communicator = Allgather()
        own(self.residual)

    def start(self, rows: Rows, name: str, group: Collectives, ops: Ops) -> Exchange:
        table = tuple(int(d) for d in rows.dense_shape)
        width = numel_of(table[1:])
        values = ops.reshape(rows.values, [-1, width])
        entry = Entry(name, [0], [table], values)
        encoded = (self.compressor.encodes_rows
                   and self.planner.route(table, ops.dtype(values), ops) == Route.COMPRESSED)
        if self.check_finite:
            entry.transaction, entry.flagged = {}, True
        with self.state_store.within(entry.transaction):
            if encoded and self.warmup.steps:
                exchange = self.warmup.count(name, ops)
                # In a traced graph the count is a tensor: no warm-up for rows there.
                encoded = not isinstance(exchange, int) or not self.warmup.dense_now(exchange)
            residual = None if self.memory.stateless else self.residual
            velocity = self.takeover.row_velocity if self.takeover.dense_momentum else None
            entry.compressor = RowsCodec(self.compressor, encoded, table, residual, velocity,
                                         transactional=self.check_finite)
            self._own(entry.compressor)
            entry.settle = entry.compressor.settle
            entry.memory, entry.communicator = NoneMemory(), self.communicator
            entry.payload, entry.ctx = entry.compressor.encode_rows(rows.indices, values, name, ops,
                                                                    group.rank)
        self.state_store.counter(ops, self._counters, "bytes_dense", payload_bytes_horovod(rows, ops))
        self.state_store.counter(ops, self._counters, "tensors", 1)
        tag = f"grace.{name}"
        sent = self.rounds.send([entry], tag, group, ops, flag_of([entry], ops))
        return Exchange(tag, [entry], 1, ops, [entry], sent, single=True)
