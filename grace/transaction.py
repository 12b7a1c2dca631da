"""The step's transaction: every state write of a step (residuals, momenta, counters) is kept, or,
if any worker's gradient held an Inf or NaN anywhere in the step, dropped on every worker, with
every result made NaN so that a loss scaler skips the step with nothing absorbed.

Each bucket's 4-byte flag rides in its first buffer (``flag_of``); a tensor allreduced as it is
or cast (fp16), with no state, carries its own Inf or NaN into the sum every worker receives and
needs none (``carries_nonfinite``). ``StepTransaction.decide`` adds the flags into one verdict and commits
or drops every pending write by it."""

from __future__ import annotations

from grace.communicator import Communicator
from grace.compressor import Compressor
from grace.exchange import Entry
from grace.memory import Memory
from grace.ops import Ops, Tensor
from grace.state import StateStore


def carries_nonfinite(compressor: Compressor, memory: Memory, communicator: Communicator) -> bool:
    """Whether a tensor sent this way needs no flag of its own: allreduced as it is, or in a cast
    that keeps Inf and NaN (``Compressor.keeps_nonfinite``), with no state, an Inf or NaN on any
    worker is in the sum every worker receives, and there is nothing to roll back."""
    return compressor.keeps_nonfinite and memory.stateless and communicator.sums


def flag_of(entries: list[Entry], ops: Ops) -> Tensor | None:
    """This worker's "some tensor of the bucket is not finite" flag (1-element float32), for the
    entries with state to roll back; ``None`` when none has."""
    flagged = [e for e in entries if e.flagged]
    if not flagged:
        return None

    def one(entry):
        return entry.flag if entry.flag is not None else ops.nonfinite_flag(entry.source)

    flag = one(flagged[0])
    for entry in flagged[1:]:
        flag = ops.maximum(flag, one(entry))
    return flag


class StepTransaction:
    """Decides a step's state writes, held in each entry's ``transaction`` (``grace.state``)."""

    def __init__(self, state_store: StateStore):
        self.state_store = state_store

    def settle(self, entry: Entry, total: Tensor, discard: Tensor, ops: Ops) -> Tensor:
        """One entry exchanged on its own (a traced branch): its writes committed unless
        ``discard``, its result NaN if they are dropped."""
        if entry.transaction is None:
            return total
        dropped = ops.is_set(discard)
        self.state_store.commit(ops, entry.transaction, dropped)
        return ops.nan_if(dropped, total)

    def decide(self, entries: list[Entry], flags: list, carried: list, scale: float,
               ops: Ops) -> None:
        """Keep or drop every pending state write of the step, by one verdict of all workers:
        the bucket's ``flags`` summed over workers, and the results (``carried``, and the entries
        combined dense without state) whose sums carry any Inf or NaN themselves. Deferred
        entries (a traced graph's branches) run now, with the verdict."""
        carried = carried + [e.result for e in entries
                             if e.deferred is None and not e.flagged and e.ready is None]
        parts = flags + [ops.nonfinite_flag(t) for t in carried]
        discard = parts[0] if parts else ops.zeros(1, "float32", like=entries[0].source)
        for part in parts[1:]:
            discard = ops.add(discard, part)
        for entry in entries:
            if entry.deferred is not None:
                entry.result = entry.deferred(discard, scale)
        dropped = ops.is_set(discard)
        for entry in entries:
            if entry.deferred is None:
                if entry.transaction is not None:
                    self.state_store.commit(ops, entry.transaction, dropped)
                if entry.settle is not None:
                    entry.settle(discard, ops)
                entry.result = ops.nan_if(dropped, entry.result)
