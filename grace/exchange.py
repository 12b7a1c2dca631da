"""A step's tensors in flight: what the pipeline's parts hand each other between a bucket's start
and the step's end.

An ``Entry`` is one unit a bucket compresses (a tensor, or several joined into one vector); a
``Sent`` is one round's collectives; an ``Exchange`` is a bucket between ``Pipeline.start_bucket``
and ``Pipeline.finish_step``, which gives each tensor back in its own shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from grace.communicator import Communicator, Started
from grace.compressor import Compressor, Context, numel_of
from grace.memory import Memory
from grace.ops import Ops, Tensor
from grace.plan import Route
from grace.sparse import Rows


@dataclass
class Entry:
    """One unit a bucket compresses: a tensor, or (``granularity="bucket"``) the bucket's float
    tensors of one dtype joined into one vector; ``positions`` and ``shapes`` say which of the
    bucket's tensors it carries."""

    name: str
    positions: list[int]
    shapes: list[tuple[int, ...]]
    source: Tensor  # as the worker computed it, before error feedback
    compressor: Compressor | None = None
    memory: Memory | None = None
    communicator: Communicator | None = None
    ctx: Context | None = None
    compensated: Tensor | None = None
    payload: list | None = None  # this round's payload, once encoded
    vote: Tensor | None = None  # an ``agrees_on_form`` compressor's vote, until agreed
    transaction: dict | None = None  # its state writes, committed with the step's verdict
    flagged: bool = False  # its non-finite flag rides with the bucket's
    ready: Tensor | None = None  # set when nothing had to travel (empty tensors)
    deferred: Callable | None = None  # traced: f(discard, scale) -> the result, run after the verdict
    result: Tensor | None = None
    owned: bool = False  # its source is read no more: error feedback may add into it
    lent: bool = False  # owned for this step only: its memory is the caller's again after it
    flag: Tensor | None = None  # its non-finite flag, taken before error feedback wrote its source
    route: Route | None = None  # how it travels, where its tensors' plan decided it (joined alike)
    settle: Callable[[Tensor, Ops], None] | None = None
    """A sparse gradient's own verdict for state it writes on the host (``RowsCodec.settle``);
    a sparse gradient's result is its rows (``Rows``)."""

    @property
    def source_given_over(self) -> bool:
        """Whether the exchange may write into ``source`` itself (sum it in place, put its result
        there): the caller gave it over (``owned``) and no state keeps it (its memory, chosen for
        this step, has none)."""
        return self.owned and self.memory is not None and self.memory.stateless


@dataclass
class Sent:
    """The collectives of one round of a bucket: per communicator, the entries it carries and what
    it started."""

    groups: list[tuple[Communicator, list[int], Started]] = field(default_factory=list)
    flag: Any = None  # the flag's own allreduce, when no communicator could carry it


@dataclass
class Exchange:
    """A bucket between ``Pipeline.start_bucket`` and ``Pipeline.finish_step``."""

    tag: str
    entries: list[Entry]
    count: int  # the bucket's tensors
    ops: Ops
    live: list[Entry]  # the entries sent in the first round
    sent: Sent
    single: bool = False  # started by ``start``: its result is the tensor itself

    def results(self) -> Any:
        """Each of the bucket's tensors in its own shape (a sparse gradient as its rows)."""
        out: list = [None] * self.count
        ops = self.ops
        for entry in self.entries:
            if entry.settle is not None:  # a sparse gradient: its rows
                table = entry.shapes[0]
                out[entry.positions[0]] = Rows(entry.ctx.data["indices"],
                                               ops.reshape(entry.result, [-1, *table[1:]]), table)
                continue
            if len(entry.positions) == 1:
                out[entry.positions[0]] = ops.reshape(entry.result, entry.shapes[0])
                continue
            pieces = ops.split(ops.flatten(entry.result), [numel_of(s) for s in entry.shapes])
            for position, shape, piece in zip(entry.positions, entry.shapes, pieces):
                out[position] = ops.reshape(piece, shape)
        return out[0] if self.single else out
