"""The rounds engine: a bucket's payloads into collectives, round after round, and back.

A compressor of one round (most) encodes, sends, and combines what comes back. One of several
rounds (PowerSGD: P, then Q from the summed P) computes each next payload from the previous one
summed over the workers. ``Rounds.run`` is a generator that pauses each time it has sent a round,
and ``run_together`` advances the step's buckets in turn, so that every bucket's next round is in
flight before any is awaited, in the same order on every worker."""

from __future__ import annotations

from typing import Generator

from grace.collectives import Collectives
from grace.communicator import Communicator
from grace.exchange import Entry, Sent
from grace.ops import Ops, Tensor
from grace.state import StateStore


def run_together(steps: list[Generator]) -> list:
    """Advance every generator one step at a time, in order, until each has returned; their
    return values, in order. Every worker so issues the buckets' rounds in the same order."""
    results: list = [None] * len(steps)
    pending = list(enumerate(steps))
    while pending:
        still = []
        for index, step in pending:
            try:
                next(step)
                still.append((index, step))
            except StopIteration as done:
                results[index] = done.value
        pending = still
    return results


def sum_payloads(payloads: list, ops: Ops) -> list:
    """Per-worker payloads added component by component (a single one is returned as it is)."""
    total = list(payloads[0])
    for payload in payloads[1:]:
        total = [ops.add(a, b) for a, b in zip(total, payload)]
    return total


class Rounds:
    """Sends and receives the rounds of a bucket's entries, counting the bytes in ``counters``
    (through ``state_store``, so that a step rolled back counts nothing)."""

    def __init__(self, state_store: StateStore, counters: dict):
        self.state_store = state_store
        self.counters = counters

    def count(self, ops: Ops, key: str, increment) -> None:
        self.state_store.counter(ops, self.counters, key, increment)

    def send(self, entries: list[Entry], tag: str, group: Collectives, ops: Ops,
             flag: Tensor | None) -> Sent:
        """Start one round's collectives: the entries' payloads by communicator (a kind each, so
        that dense and compressed payloads of one bucket each travel packed), ``flag`` inside the
        first that can carry it, else in an allreduce of its own."""
        by_kind: dict[type, tuple[Communicator, list[int]]] = {}
        for i, entry in enumerate(entries):
            by_kind.setdefault(type(entry.communicator), (entry.communicator, []))[1].append(i)
        sent = Sent()
        for communicator, members in by_kind.values():
            started = communicator.start([entries[i].payload for i in members],
                                         [not entries[i].compressor.fixed_size for i in members],
                                         flag, tag, group, ops, [entries[i] for i in members])
            if started.carries_flag:
                flag = None
            self.count(ops, "bytes_sent", started.bytes_sent)
            if started.bytes_control:
                self.count(ops, "bytes_control", started.bytes_control)
            sent.groups.append((communicator, members, started))
        if flag is not None:
            self.count(ops, "bytes_control", ops.nbytes(flag))
            sent.flag = group.allreduce_async(flag, f"{tag}.nonfinite")
        return sent

    def receive(self, sent: Sent, group: Collectives, ops: Ops) -> tuple[list[list], Tensor | None]:
        """Wait for one round: per entry its payloads (one summed, or one per worker), and the
        flag summed over workers."""
        payloads: list[list] = [[] for _ in range(sum(len(m) for _, m, _ in sent.groups))]
        flag = None
        for communicator, members, started in sent.groups:
            received, carried = communicator.finish(started, group, ops)
            self.count(ops, "bytes_received", started.bytes_received)
            if not isinstance(started.bytes_later, int) or started.bytes_later:
                self.count(ops, "bytes_sent", started.bytes_later)
            for i, payload in zip(members, received):
                payloads[i] = payload
            if carried is not None:
                flag = carried
        if sent.flag is not None:
            flag = group.synchronize(sent.flag)
        return payloads, flag

    def collect(self, entries: list[Entry], sent: Sent, tag: str, group: Collectives, ops: Ops,
                scale: float) -> tuple[list[Tensor], Tensor | None]:
        """The entries' sums over workers times ``scale``, their state writes still pending, and
        the bucket's flag (``run`` to its end)."""
        return run_together([self.run(entries, sent, tag, group, ops, scale)])[0]

    def run(self, entries: list[Entry], sent: Sent, tag: str, group: Collectives, ops: Ops,
            scale: float) -> Generator[None, None, tuple[list[Tensor], Tensor | None]]:
        """``collect`` as steps: it pauses each time it has sent a round. Error feedback keeps
        what this worker's own last payload leaves out. Each round is one exchange for the
        bucket."""
        payloads, flag = self.receive(sent, group, ops)
        step = 1
        while True:
            step += 1
            later = [i for i, e in enumerate(entries) if e.compressor.rounds >= step]
            if not later:
                break
            # The bucket's next payloads at once (only the pipeline's own compressor has more
            # rounds than one): PowerSGD batches its orthogonalizations.
            compressor = entries[later[0]].compressor
            following = compressor.second_rounds([sum_payloads(payloads[i], ops) for i in later],
                                                 [entries[i].ctx for i in later], ops)
            for i, payload in zip(later, following):
                entry = entries[i]
                entry.payload = payload
                if compressor.rounds == step:
                    with self.state_store.within(entry.transaction):
                        entry.memory.update(entry.compensated, entry.name, compressor, payload,
                                            entry.ctx, ops)
            round_sent = self.send([entries[i] for i in later], f"{tag}.{step}", group, ops, None)
            yield  # the other buckets send theirs while this round travels
            received, _ = self.receive(round_sent, group, ops)
            for i, payload in zip(later, received):
                payloads[i] = payload
                entry = entries[i]
                if entry.compressor.rounds == step:
                    with self.state_store.within(entry.transaction):
                        entry.compressor.after_aggregate(sum_payloads(payload, ops), entry.ctx, ops)
        totals = []
        for entry, payload in zip(entries, payloads):
            with self.state_store.within(entry.transaction):
                totals.append(entry.compressor.aggregate_into(payload, entry.ctx, ops, scale,
                                                              result_place(entry)))
        return totals, flag


def result_place(entry: Entry) -> Tensor | None:
    """Where ``entry``'s result may be written: its source, where it is given over
    (``Entry.source_given_over``: the caller's, with no state keeping it), else ``None``. A DDP
    bucket's gradients then get their results in place, and Horovod's in the gradients' own
    memory, with no new tensor per step."""
    return entry.source if entry.source_given_over else None
