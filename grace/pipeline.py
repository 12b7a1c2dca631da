"""The pipeline a factory such as ``grace.topk(0.01)`` returns: compression with error feedback,
and the fused exchange of buckets of tensors."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator, Sequence

from grace import hierarchy
from grace.bucketing import DEFAULT_BUCKET_BYTES, bucket_tag, form_buckets
from grace.collectives import Collectives
from grace.communicator import Communicator, Started
from grace.communicators.allgather import Allgather
from grace.communicators.allreduce import Allreduce
from grace.communicators.alltoall import ShardCodec, keeps_residual
from grace.compressor import Compressor, Context, numel_of
from grace.compressors.none import NoneCompressor
from grace.memories.momentum import MomentumMemory
from grace.memories.none import NoneMemory
from grace.memories.residual import DelayedResidualMemory, ResidualMemory
from grace.memory import Memory
from grace.momentum import OptimizerMomentum, owner
from grace.ops import FLOAT_DTYPES, Ops, Tensor, ops_for
from grace.second_moment import SharedSecondMoment
from grace.sparse import RowResidual, Rows, RowsCodec, RowVelocity, payload_bytes_horovod
from grace.state import StateStore, plain

GRANULARITIES = ("layer", "bucket")


def takes_overwrite(memory: Memory) -> bool:
    """Whether ``memory.compensate`` takes ``overwrite`` (a memory written before it was, with
    ``compensate(tensor, name, ops)``, keeps working: it is called as it was written)."""
    kind = type(memory)
    if kind not in _TAKES_OVERWRITE:
        _TAKES_OVERWRITE[kind] = "overwrite" in inspect.signature(kind.compensate).parameters
    return _TAKES_OVERWRITE[kind]


_TAKES_OVERWRITE: dict[type, bool] = {}


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
    flag: Tensor | None = None  # its non-finite flag, taken before error feedback wrote its source
    plan: str | None = None  # how it travels, where its tensors' plan decided it (joined alike)


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
        out: list = [None] * self.count
        ops = self.ops
        for entry in self.entries:
            if isinstance(entry.compressor, RowsCodec):  # a sparse gradient: its rows
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


def _run_together(steps: list[Generator]) -> list:
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


def _sum_payloads(payloads: list, ops: Ops) -> list:
    """Per-worker payloads added component by component (a single one is returned as it is)."""
    total = list(payloads[0])
    for payload in payloads[1:]:
        total = [ops.add(a, b) for a, b in zip(total, payload)]
    return total


BUILT_WHILE_TRACING: list[Callable[[], Any]] = []
"""Functions, one per framework that traces (registered by its adapter), that give where the user's
code is building a pipeline while that framework traces a function (``tf.function``): the line of
the user's code, or ``None`` when it is not tracing. A pipeline built then keeps it in
``built_while_tracing``."""


class Pipeline:
    """Compression of gradients with error feedback, and their exchange in buckets.

    Per tensor, in the order error feedback requires: ``memory.compensate`` →
    ``compressor.compress`` → ``memory.update``; then, per bucket, one collective per kind of
    payload and round for all its tensors (``start_bucket``): summed payloads joined per dtype
    into one allreduce, gathered payloads packed as bytes into one allgather, each worker's lengths
    inside it for payloads whose size varies; and back: ``compressor.decompress`` →
    ``compressor.aggregate`` → scale. A compressor of two rounds (PowerSGD) sends its second round
    for the whole bucket at once. Wrappers group tensors into buckets of ``bucket_bytes`` dense bytes
    (``buckets``), in the order the backward pass makes them, and start a bucket as soon as its
    last tensor is ready: few collectives, each overlapping the rest of the backward pass.

    ``granularity="layer"`` (default) compresses each tensor on its own (the payloads of a bucket
    of one); ``"bucket"`` compresses a bucket's float tensors of one dtype as one vector (top-k over
    the bucket, one scale per bucket), as the theory of whole-model compression has it: its state
    is keyed by the bucket, so the buckets must be the same in every step.

    At ``granularity="layer"``, an element-wise codec without state (``none``, ``fp16`` over
    allreduce) still encodes a bucket's tensors of one dtype and plan as one vector: the same bits,
    with its fixed costs (flag, encoding, decoding) paid once per bucket rather than per tensor.

    Tensors the compressor cannot help travel dense through allreduce, with no memory (``plan``):
    those with fewer than ``min_numel`` elements, those whose compressed payload would not be
    smaller than the dense tensor, and integer or boolean tensors. Empty tensors never reach a
    collective.

    Non-finite gradients (``check_finite``, on by default): each bucket's 4-byte flag rides in its
    first buffer (a tensor that travels dense carries its own Inf or NaN into the sum), and the
    state writes (residuals, momenta, counters) stay pending until the step is decided
    (``finish_step``): if any worker's gradient held an Inf or NaN in any tensor of the step, every
    worker drops the writes of every tensor, leaving the whole state as it was before the step, and
    returns NaN, so that a loss scaler sees the overflow and skips the step with nothing absorbed.
    Eagerly and under tf.function alike.

    Warm-up (``warmup_steps``): the first ``warmup_steps`` exchanges of each tensor travel dense
    (allreduce, no memory, counted in ``stats()`` as dense bytes sent), as PyTorch's PowerSGD hook
    (``start_powerSGD_iter``), DGC's warm-up epochs and 1-bit Adam's freeze step do: early
    gradients are large and change fast, which delayed residuals and quantization noise handle
    worst. Exchanges are counted per tensor, skipped steps included; the count is saved state.

    ``stats()`` reports, cumulatively for this worker, the payload bytes put into collectives
    (``bytes_sent``) against the bytes of the dense tensors (``bytes_dense``).

    Sparse gradients (an embedding's: rows of a table) travel as rows (``start_sparse``,
    ``grace.sparse``): repeats added up, error feedback kept as rows, the rows encoded by the
    compressor, gathered from every worker, and combined per row.

    This object is what a Horovod script passes as ``compression=``; the framework wrappers drive
    ``start_bucket`` from their hooks and ``finish_step`` before the optimizer steps.
    """

    def __init__(self, compressor: Compressor, memory: Memory, communicator: Communicator,
                 min_numel: int = 0, check_finite: bool = True, warmup_steps: int = 0,
                 granularity: str = "layer", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 hierarchical: bool = False, keep_optimizer: bool = False):
        communicator.bind(compressor, memory)
        if granularity == "bucket" and not compressor.accepts((2**20,)):
            raise ValueError(f"granularity='bucket' joins a bucket's tensors into one vector, which "
                             f"{compressor.name!r} cannot compress (it needs a matrix): use "
                             f"granularity='layer'")
        self.compressor = compressor
        self.memory = memory
        self.communicator = communicator
        self.min_numel = min_numel
        self.check_finite = check_finite
        self.warmup_steps = warmup_steps
        self.granularity = granularity
        self.bucket_bytes = bucket_bytes
        self.hierarchical = hierarchical
        self.keep_optimizer = keep_optimizer
        """Leave the wrapped optimizer as the user set it: take neither its momentum nor Adam's
        moments over; a part that applies momentum itself applies only what it was given."""
        self._kept_notes: list[str] = []  # said by take_momentum where it changed nothing
        self.built_while_tracing = next(
            (site for site in (where() for where in BUILT_WHILE_TRACING) if site is not None), None)
        """Where the user's code built it inside a function being traced (Horovod's examples
        build their compression inside the ``tf.function`` step), else ``None``: the framework's
        wrapper shares the one pipeline that line builds among the traces
        (``frameworks/tensorflow/keras3.py``)."""
        self._exchanges: dict = {}  # per tensor: how many exchanges the warm-up has counted
        self._dense_compressor = NoneCompressor()
        self._dense_memory = NoneMemory()
        self._taken: tuple | None = None  # the optimizer's momentum, once taken over
        self._moments: SharedSecondMoment | None = None  # Adam's second moment, once taken over
        self._dense_communicator = Allreduce()
        self._row_residual = RowResidual()  # sparse gradients' error feedback, as rows
        self._row_velocity = RowVelocity()  # their momentum, when taken over
        self._row_communicator = Allgather()
        # Error feedback at a shard's owner (communicator="alltoall"), where the workers keep some.
        self._owner_memory = (ResidualMemory() if communicator.shards and keeps_residual(memory)
                              else NoneMemory())
        self._sharded: dict[int, ShardCodec] = {}
        self.state_store = StateStore()
        """This pipeline's state and its step's transaction (``grace.state``), which every part
        it drives reads and writes through."""
        self._own(compressor, memory, self._dense_compressor, self._dense_memory, self._row_residual,
                  self._row_velocity, self._owner_memory)
        part = owner(self)
        if keep_optimizer and part is not None and part.momentum_given is None:
            part.momentum = 0.0  # nothing of the optimizer's is taken, and no default added
        self.reset_stats()

    def _own(self, *parts: Any) -> None:
        """Give ``parts`` this pipeline's state store."""
        for part in parts:
            part.state_store = self.state_store

    def __repr__(self) -> str:
        dense = "" if isinstance(self._dense_memory, NoneMemory) else f", dense_memory={self._dense_memory!r}"
        return (f"Pipeline(compressor={self.compressor!r}, memory={self.memory!r}{dense}, "
                f"communicator={self.communicator!r}, min_numel={self.min_numel}, "
                f"check_finite={self.check_finite}, warmup_steps={self.warmup_steps}, "
                f"granularity={self.granularity!r}, bucket_bytes={self.bucket_bytes}"
                + (", hierarchical=True" if self.hierarchical else "")
                + (", keep_optimizer=True" if self.keep_optimizer else "")
                + (f", adam={self._moments!r})" if self._moments is not None else ")"))

    # --- what Horovod's own optimizer would call -----------------------------------------------
    def compress(self, tensor):
        raise TypeError(
            "a grace pipeline reached Horovod's own DistributedOptimizer, which can only allreduce. "
            "Import grace before calling hvd.DistributedOptimizer (grace routes it), or use "
            "frameworks.torch.DistributedOptimizer / frameworks.tensorflow.DistributedGradientTape."
        )

    decompress = compress

    # --- momentum taken over from the optimizer -------------------------------------------------
    def take_momentum(self, found: OptimizerMomentum, adam: bool = False) -> str | None:
        """Hand the wrapped optimizer's momentum (``found``) to the part of this pipeline that
        applies momentum itself, if there is one; the caller then has the optimizer step without
        it. The tensors that travel dense get ``found`` from here on, applied before the exchange,
        so that every tensor keeps the momentum the optimizer gave it. Returns the sentence to log
        once, or ``None`` when nothing was taken (``adam``: ``found`` is Adam's ``beta_1``, taken
        only by the algorithms that ask for it). See ``grace.momentum``."""
        part = owner(self)
        if part is None or (adam and not part.takes_adam_beta1) or self.keep_optimizer:
            return None
        if found.momentum == 0.0:
            if part.momentum_given is None and not part.keeps_default_momentum:
                part.momentum = 0.0  # the optimizer as it is: no momentum there, none here
            kept = part.kept_line(found, self.compressor.name)
            if kept is not None:
                self._kept_notes.append(kept)
            return None
        self._apply_momentum(part, found)
        return part.takeover_line(found, self.compressor.name)

    def notices(self, size: int, optimizer_seen: bool = True,
                wrapper: str = "DistributedGradientTape") -> list[str]:
        """The sentences a wrapper logs once on rank 0 when it is built for a job of ``size``
        workers: each way this pipeline departs from what the user set and nothing else says
        (``take_momentum``'s and ``take_adam_moments``' own lines aside): a compressor's floor
        under its ratio, the route ``communicator="auto"`` takes at this size, a compressor's own
        momentum kept over an optimizer without one, and, where the wrapper sees no optimizer
        (``optimizer_seen=False``: ``DistributedGradientTape``, or a DDP hook: ``wrapper`` names
        it), the momentum a compressor applies itself or needs to be given."""
        lines = [self.compressor.notice(), self.communicator.notice(size, self.compressor.name),
                 *self._kept_notes]
        part = owner(self)
        if not optimizer_seen and part is not None and not self.keep_optimizer:
            lines.append(part.unseen_optimizer_line(self.compressor.name, wrapper))
        if self.keep_optimizer and part is not None:
            lines.append(part.dropped_default_line(self.compressor.name))
        if not optimizer_seen:
            lines.append(self.compressor.learning_rate_notice(None))
        return [line for line in lines if line is not None]

    def adam_caution(self, optimizer: str) -> str | None:
        """The line a wrapper logs once when this pipeline wraps Adam (``optimizer`` names it), where
        the compressor is measured to fall short with Adam (``Compressor.adam_caution``) and did
        not take Adam's moments over (``take_adam_moments``), else ``None``."""
        caution = self.compressor.adam_caution
        if caution is None or self._moments is not None:
            return None
        return f"grace: {self.compressor.name} with {optimizer}: {caution}"

    def take_adam_moments(self, beta2: float, eps: float, averaged: bool = True) -> str | None:
        """Take the wrapped Adam's moments over, where the compressor steps better with them
        (random-k: ``grace.second_moment``): its compressed tensors then come out of the exchange
        as the update to step by the learning rate, ``burst / (sqrt(v) + eps)``, which the wrapper
        steps itself (``steps_itself``), the optimizer stepping the rest as it is. Needs the
        compressor's own error feedback over a plain allreduce, tensor by tensor, without warm-up,
        and workers' gradients averaged (``averaged``: ``hvd.Average`` without a predivide
        factor): where one of those is not so, nothing is taken (``None``). Called again before
        each step with the optimizer's settings as they are then. Returns the sentence to log once,
        or ``None``."""
        takes = getattr(self.compressor, "can_take_second_moment", False)
        if not (takes and averaged and not self.keep_optimizer and type(self.memory) is DelayedResidualMemory
                and type(self.communicator) is Allreduce and not self.hierarchical
                and self.granularity == "layer" and not self.warmup_steps):
            return None
        if self._moments is not None:
            self._moments.retake(beta2, eps)
            return None
        moments = SharedSecondMoment(beta2, eps)
        self._own(moments)
        self._moments = self.compressor.moments = self.memory.moments = moments
        return (f"grace: {self.compressor.name} takes Adam's moments over for the tensors it "
                f"compresses: it divides its error feedback's updates by every worker's second "
                f"moment (beta2 {moments.beta2}, eps {moments.eps}), sent with the drawn entries "
                f"(twice the values), steps them by the learning rate without a first moment "
                f"(momentum on ~1/ratio-step-late updates diverges), and the optimizer steps the "
                f"rest as it is (docs/quality.md, 'With Adam')")

    @property
    def adam_moments_taken(self) -> bool:
        """Whether ``take_adam_moments`` took them (once, for every wrapper of this pipeline)."""
        return self._moments is not None

    def steps_itself(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> bool:
        """Whether a tensor of this shape and dtype comes out of the exchange as the update that
        the wrapper steps by the learning rate (Adam's moments taken over, ``take_adam_moments``),
        rather than as the gradient for the optimizer."""
        return self._moments is not None and self.plan(tuple(shape), dtype, ops) == "compressed"

    def retake_momentum(self, found: OptimizerMomentum) -> None:
        """The momentum taken over, as the optimizer's settings now say it (they may have been
        replaced since: ``hvd.broadcast_optimizer_state`` gives every worker rank 0's, a resumed
        ``load_state_dict`` the saved ones). Nothing changes when they are as taken, or when none
        was taken. The velocities are kept."""
        if self._taken is None or self._taken == (found.momentum, found.nesterov, found.dampening):
            return
        self._apply_momentum(owner(self), found)

    def _apply_momentum(self, part: Any, found: OptimizerMomentum) -> None:
        part.take_momentum(found)
        if isinstance(self._dense_memory, MomentumMemory):  # retaken: the same velocities
            dense = self._dense_memory
            dense.momentum, dense.nesterov, dense.dampening = (found.momentum, found.nesterov,
                                                               found.dampening)
        else:
            dense = MomentumMemory(found.momentum, found.nesterov, found.dampening)
            if isinstance(part, MomentumMemory) and part.momentum_params() == dense.momentum_params():
                # One velocity per tensor: a warm-up's dense steps build what compression continues.
                dense.velocities = part.velocities
        self._own(dense)
        self._dense_memory = dense
        rows = self._row_velocity
        rows.momentum, rows.nesterov, rows.dampening = found.momentum, found.nesterov, found.dampening
        self._taken = (found.momentum, found.nesterov, found.dampening)

    # --- what travels how ------------------------------------------------------------------------
    def plan(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> str:
        """How a tensor of this shape and dtype travels: ``"empty"`` (nothing to send),
        ``"dense"`` (allreduce, no memory) or ``"compressed"``. Every wrapper asks this one
        question; the warm-up may still send a compressed tensor dense in a given step."""
        numel = numel_of(shape)
        if numel == 0:
            return "empty"
        if dtype not in FLOAT_DTYPES or numel < max(self.min_numel, 1):
            return "dense"
        if not self.compressor.accepts(tuple(shape)):
            return "dense"
        itemsize = ops.itemsize(dtype)
        estimate = self.compressor.payload_nbytes(tuple(shape), itemsize)
        return "compressed" if estimate is None or estimate < numel * itemsize else "dense"

    @property
    def starts_waiting(self) -> bool:
        """Whether starting a bucket waits for the other workers: a vote on the payload's form
        (``agrees_on_form``), or the host's dense sum (``hierarchical``). Such a start must come in
        the same order on every worker, which backward's hooks do not promise (a worker whose graph
        skips a parameter completes its buckets in another order, or in ``synchronize``)."""
        return self.hierarchical or self.compressor.agrees_on_form

    def compresses(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> bool:
        """Whether a tensor of this shape and dtype is compressed, or travels dense."""
        return self.plan(shape, dtype, ops) == "compressed"

    def buckets(self, tensors: Sequence[tuple[Sequence[int], str]], ops: Ops) -> list[list[int]]:
        """Positions of ``tensors`` ((shape, dtype) each, in the order they become ready) grouped
        into buckets of at most ``bucket_bytes`` dense bytes (a larger tensor alone). A bucket
        holds tensors of one dtype that travel alike (``plan``; at ``granularity="bucket"`` the
        float ones are compressed together whatever their size), so that each round of a bucket is
        one collective. Every worker forms the same buckets from the same tensors."""
        def kind(shape, dtype):
            if self.granularity == "bucket" and dtype in FLOAT_DTYPES:
                return dtype, "joined"
            return dtype, self.plan(tuple(shape), dtype, ops)
        return form_buckets([numel_of(shape) * ops.itemsize(dtype) for shape, dtype in tensors],
                            self.bucket_bytes, [kind(shape, dtype) for shape, dtype in tensors])

    # --- the exchange --------------------------------------------------------------------------
    def start(self, tensor: Tensor, name: str, group: Collectives, ops: Ops | None = None) -> Exchange:
        """Compress one tensor (with error feedback) and start its collectives: a bucket of one,
        whose ``finish`` returns the tensor itself."""
        exchange = self.start_bucket([tensor], [name], group, ops)
        exchange.single = True
        return exchange

    def start_sparse(self, rows: Rows, name: str, group: Collectives, ops: Ops | None = None
                     ) -> Exchange:
        """Start the exchange of a sparse gradient (``grace.sparse``): its distinct rows, with
        error feedback, encoded by the compressor where it would compress the table (``plan``) and
        can encode rows (``Compressor.encodes_rows``), else as they are, gathered from every worker
        in one collective with the non-finite flag. ``finish`` returns the rows combined over the
        workers, one per distinct index, as ``Rows``."""
        ops = ops or ops_for(rows.values)
        if self.hierarchical:
            raise ValueError(f"hierarchical=True sums each host's gradients dense before "
                             f"compressing, which a sparse gradient ({name!r}) cannot be: pass "
                             f"sparse_as_dense=True to the optimizer wrapper")
        table = tuple(int(d) for d in rows.dense_shape)
        width = numel_of(table[1:])
        values = ops.reshape(rows.values, [-1, width])
        entry = Entry(name, [0], [table], values)
        encoded = (self.compressor.encodes_rows
                   and self.plan(table, ops.dtype(values), ops) == "compressed")
        if self.check_finite:
            entry.transaction, entry.flagged = {}, True
        with self.state_store.within(entry.transaction):
            if encoded and self.warmup_steps:
                exchange = self.state_store.counter(ops, self._exchanges, name)
                # In a traced graph the count is a tensor: no warm-up for rows there.
                encoded = not isinstance(exchange, int) or exchange >= self.warmup_steps
            residual = None if isinstance(self.memory, NoneMemory) else self._row_residual
            velocity = self._row_velocity if self._taken is not None else None
            entry.compressor = RowsCodec(self.compressor, encoded, table, residual, velocity,
                                         transactional=self.check_finite)
            self._own(entry.compressor)
            entry.memory, entry.communicator = NoneMemory(), self._row_communicator
            entry.payload, entry.ctx = entry.compressor.encode_rows(rows.indices, values, name, ops,
                                                                    group.rank)
        self.state_store.counter(ops, self._counters, "bytes_dense", payload_bytes_horovod(rows, ops))
        self.state_store.counter(ops, self._counters, "tensors", 1)
        tag = f"grace.{name}"
        sent = self._send_round([entry], tag, group, ops, self._flag_of([entry], ops))
        return Exchange(tag, [entry], 1, ops, [entry], sent, single=True)

    def start_bucket(self, tensors: Sequence[Tensor], names: Sequence[str], group: Collectives,
                     ops: Ops | None = None, overwrite: bool = False) -> Exchange:
        """Compress a bucket of tensors and start its exchange: one collective per kind of payload
        (summed: one per dtype; gathered: one) for all of them, the non-finite flag inside. At
        ``granularity="bucket"`` the bucket's float tensors of one dtype are compressed as one
        vector. Every worker starts the same buckets, in the same order. ``overwrite``: the caller
        reads the tensors no more (gradients the exchange's results replace, as Horovod's
        allreduce writes over them), so error feedback adds its residual into them instead of
        into a full-size tensor of its own each step; the values computed are the same. (With
        ``hierarchical=True`` the host's sums are compressed, tensors of the pipeline's own.)"""
        ops = ops or ops_for(tensors[0])
        if self.hierarchical:  # dense within the host, compressed between hosts (grace.hierarchy)
            return hierarchy.start(tensors, names, group, ops, self._start_flat,
                                   lambda n: self.state_store.counter(ops, self._counters,
                                                                      "bytes_local", n))
        return self._start_flat(tensors, names, group, ops, overwrite)

    def _start_flat(self, tensors: Sequence[Tensor], names: Sequence[str], group: Collectives,
                    ops: Ops, overwrite: bool = False) -> Exchange:
        tag = bucket_tag(names)
        entries = self._entries(list(tensors), list(names), ops, overwrite)
        for entry in entries:
            self._prepare(entry, group, ops)
        self._vote(entries, tag, group, ops)
        live = [e for e in entries if e.payload is not None]
        sent = self._send_round(live, tag, group, ops, self._flag_of(entries, ops))
        return Exchange(tag, entries, len(tensors), ops, live, sent)

    def _entries(self, tensors: list, names: list, ops: Ops, overwrite: bool = False) -> list[Entry]:
        """The units a bucket compresses: each tensor (``granularity="layer"``), or its float
        tensors of one dtype joined into one vector named after the bucket (``"bucket"``, a
        vector of the pipeline's own, which error feedback may write into)."""
        whole = [Entry(name, [i], [ops.shape(t)], t, owned=overwrite)
                 for i, (t, name) in enumerate(zip(tensors, names))]
        if len(tensors) > 1 and self._joins_alike():
            return self._joined_alike(whole, ops)
        if self.granularity == "layer" or len(tensors) == 1:
            return whole
        joined: dict[str, list[int]] = {}
        for i, t in enumerate(tensors):
            if ops.dtype(t) in FLOAT_DTYPES and ops.numel(t) > 0:
                joined.setdefault(ops.dtype(t), []).append(i)
        entries = [whole[i] for i in range(len(tensors)) if not any(i in g for g in joined.values())]
        for dtype, positions in joined.items():
            name = f"bucket.{names[positions[0]]}" + (f".{dtype}" if len(joined) > 1 else "")
            flat = ops.concat([ops.flatten(tensors[i]) for i in positions])
            entries.append(Entry(name, positions, [ops.shape(tensors[i]) for i in positions], flat,
                                 owned=True))  # ``Ops.concat`` makes a new tensor
        return entries

    def _joins_alike(self) -> bool:
        """Whether a bucket's tensors may be encoded as one vector at ``granularity="layer"`` (the
        other granularity joins them anyway), with the same bits as one by one: an element-wise
        codec (a cast, or none) that keeps no state (no memory, no momentum taken over, no warm-up
        to count per tensor), summed by allreduce. Then each kind of tensor costs one encoding,
        one flag and one decoding per bucket instead of per tensor: on a GPU, a dozen kernel
        launches per tensor (docs/performance.md)."""
        return (self.granularity == "layer" and self.compressor.elementwise
                and isinstance(self.memory, NoneMemory)
                and type(self.communicator) is Allreduce and self._taken is None
                and self._moments is None and not self.warmup_steps)

    def _joined_alike(self, whole: list[Entry], ops: Ops) -> list[Entry]:
        """``whole``'s float tensors joined into one entry per (dtype, plan), each entry keeping
        its tensors' plan; the others (empty, integer) as they are."""
        groups: dict[tuple[str, str], list[Entry]] = {}
        kept = []
        for entry in whole:
            dtype = ops.dtype(entry.source)
            plan = self.plan(tuple(ops.shape(entry.source)), dtype, ops)
            if dtype in FLOAT_DTYPES and plan in ("dense", "compressed"):
                groups.setdefault((dtype, plan), []).append(entry)
            else:
                kept.append(entry)
        for (dtype, plan), members in groups.items():
            if len(members) == 1:
                kept.append(members[0])
                continue
            flat = ops.concat([ops.flatten(e.source) for e in members])
            kept.append(Entry(f"joined.{members[0].name}.{plan}", [e.positions[0] for e in members],
                              [e.shapes[0] for e in members], flat, owned=True, plan=plan))
        return kept

    def _prepare(self, entry: Entry, group: Collectives, ops: Ops) -> None:
        """Decide how ``entry`` travels this step and encode it (a vote first, for a compressor
        that ``agrees_on_form``; in a traced graph the warm-up's choice is deferred)."""
        shape, dtype = ops.shape(entry.source), ops.dtype(entry.source)
        plan = entry.plan or self.plan(shape, dtype, ops)
        if plan == "empty":
            entry.ready = ops.copy(entry.source)
            return
        dense, count = plan == "dense", False
        if not dense and self.warmup_steps:
            # Read here; counted with the step's other state writes, so a skipped step undoes it.
            exchange = self.state_store.counter(ops, self._exchanges, entry.name, 0)
            if not isinstance(exchange, int):
                entry.flagged = self.check_finite
                entry.deferred = self._traced_warmup(entry, exchange, group, ops)
                return
            dense, count = exchange < self.warmup_steps, True
        self._route(entry, dense, count, group, ops)

    def _route(self, entry: Entry, dense: bool, count: bool, group: Collectives, ops: Ops) -> None:
        """Compensate ``entry`` and encode it dense or compressed, its state writes pending in its
        transaction; ``count``: count the exchange for the warm-up."""
        if dense:
            entry.compressor, entry.memory, entry.communicator = (
                self._dense_compressor, self._dense_memory, self._dense_communicator)
        else:
            entry.compressor, entry.memory, entry.communicator = (
                self.compressor, self.memory, self.communicator.resolve(group.size))
            if entry.communicator.shards:
                entry.compressor, entry.communicator = self._sharding(entry, group, ops)
        carries = self._carries_nonfinite(entry.compressor, entry.memory, entry.communicator)
        if self.check_finite and (count or not carries):
            entry.transaction = {}
            entry.flagged = not carries
        source = entry.source
        if entry.owned and entry.flagged:  # read before error feedback writes into the source
            entry.flag = ops.nonfinite_flag(source)
        with self.state_store.within(entry.transaction):
            if count:
                self.state_store.counter(ops, self._exchanges, entry.name)
            if entry.owned and takes_overwrite(entry.memory):
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

    def _sharding(self, entry: Entry, group: Collectives, ops: Ops) -> tuple[Compressor, Communicator]:
        """A sharding communicator's codec, one shard per worker; a tensor with fewer elements
        than workers (or a group of one) is gathered as it is."""
        if group.size < 2 or ops.numel(entry.source) < group.size:
            return self.compressor, self._row_communicator
        codec = self._sharded.get(group.size)
        if codec is None:
            codec = self._sharded[group.size] = ShardCodec(self.compressor, group.size,
                                                           self._owner_memory)
            self._own(codec, codec.owner)
        return codec, entry.communicator

    def _encode(self, entry: Entry, group: Collectives, ops: Ops) -> None:
        with self.state_store.within(entry.transaction):
            entry.payload, entry.ctx = entry.compressor.compress(entry.compensated, entry.name, ops,
                                                                 rank=group.rank)
            if entry.compressor.rounds == 1:
                entry.memory.update(entry.compensated, entry.name, entry.compressor, entry.payload,
                                    entry.ctx, ops)

    def _vote(self, entries: list[Entry], tag: str, group: Collectives, ops: Ops) -> None:
        """For a compressor whose encoded size depends on the data (``agrees_on_form``): the
        workers agree, by one allreduce of a 4-byte vote per tensor for the whole bucket, whether
        every one of them sends a tensor encoded (each, lengths included, smaller than the tensor)
        or all send it dense through allreduce (exactly the dense bytes). Deciding alone, a worker
        would have to say which form it sent, in bytes beyond the dense tensor's. Each vote comes
        from the tensor before it is encoded (``Compressor.not_smaller``), so a dense step encodes
        nothing."""
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
                    entry.compressor, entry.communicator = self._dense_compressor, self._dense_communicator
                self._encode(entry, group, ops)
            else:  # a traced graph: the agreement is known when it runs
                entry.deferred = self._traced_agreement(entry, dense, group, ops)

    def _traced_agreement(self, entry: Entry, dense: Any, group: Collectives, ops: Ops) -> Callable:
        def deferred(discard, scale):
            def run(dense_way: bool):
                branch = replace(entry, transaction=None if entry.transaction is None
                                 else dict(entry.transaction))  # each branch its own writes
                if dense_way:
                    branch.compressor, branch.communicator = (self._dense_compressor,
                                                              self._dense_communicator)
                self._encode(branch, group, ops)
                return self._exchange_now(branch, group, ops, scale, discard)
            return ops.cond(dense, lambda: run(True), lambda: run(False))
        return deferred

    def _traced_warmup(self, entry: Entry, exchange: Any, group: Collectives, ops: Ops) -> Callable:
        """In a traced graph the exchange count is only known when the graph runs: both ways are
        built, and the count picks one then. The state written inside a branch must be committed
        there, so the branch runs once the step's verdict is known (``finish_step``)."""
        def deferred(discard, scale):
            def way(dense: bool):
                branch = Entry(entry.name, entry.positions, entry.shapes, entry.source)
                self._route(branch, dense, False, group, ops)
                self._vote([branch], f"grace.{entry.name}", group, ops)
                if branch.deferred is not None:
                    return branch.deferred(discard, scale)
                return self._exchange_now(branch, group, ops, scale, discard)
            result = ops.cond(exchange < self.warmup_steps, lambda: way(True), lambda: way(False))
            counted: dict | None = {} if self.check_finite else None
            with self.state_store.within(counted):
                self.state_store.counter(ops, self._exchanges, entry.name)
            if counted is not None:
                self.state_store.commit(ops, counted, ops.is_set(discard))
            return result
        return deferred

    def _exchange_now(self, entry: Entry, group: Collectives, ops: Ops, scale: float,
                      discard: Tensor) -> Tensor:
        """One encoded entry's whole exchange, its writes committed unless ``discard``."""
        sent = self._send_round([entry], f"grace.{entry.name}", group, ops, None)
        total = self._collect([entry], sent, f"grace.{entry.name}", group, ops, scale)[0][0]
        if entry.transaction is None:
            return total
        dropped = ops.is_set(discard)
        self.state_store.commit(ops, entry.transaction, dropped)
        return ops.nan_if(dropped, total)

    @staticmethod
    def _carries_nonfinite(compressor, memory, communicator) -> bool:
        """A tensor allreduced as it is, with no state, needs no flag: an Inf or NaN on any worker
        is in the sum every worker receives, and there is nothing to roll back."""
        return (isinstance(compressor, NoneCompressor) and isinstance(memory, NoneMemory)
                and isinstance(communicator, Allreduce))

    def _flag_of(self, entries: list[Entry], ops: Ops) -> Tensor | None:
        """This worker's "some tensor of the bucket is not finite" flag (1-element float32), for
        the entries with state to roll back; a tensor allreduced as it is carries its own Inf or
        NaN into the sum every worker receives."""
        flagged = [e for e in entries if e.flagged]
        if not flagged:
            return None
        def flag_of(entry):
            return entry.flag if entry.flag is not None else ops.nonfinite_flag(entry.source)

        flag = flag_of(flagged[0])
        for entry in flagged[1:]:
            flag = ops.maximum(flag, flag_of(entry))
        return flag

    def _send_round(self, entries: list[Entry], tag: str, group: Collectives, ops: Ops,
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
            self.state_store.counter(ops, self._counters, "bytes_sent", started.bytes_sent)
            if started.bytes_control:
                self.state_store.counter(ops, self._counters, "bytes_control", started.bytes_control)
            sent.groups.append((communicator, members, started))
        if flag is not None:
            self.state_store.counter(ops, self._counters, "bytes_control", ops.nbytes(flag))
            sent.flag = group.allreduce_async(flag, f"{tag}.nonfinite")
        return sent

    def _receive(self, sent: Sent, group: Collectives, ops: Ops) -> tuple[list[list], Tensor | None]:
        """Wait for one round: per entry its payloads (one summed, or one per worker), and the
        flag summed over workers."""
        payloads: list[list] = [[] for _ in range(sum(len(m) for _, m, _ in sent.groups))]
        flag = None
        for communicator, members, started in sent.groups:
            received, carried = communicator.finish(started, group, ops)
            self.state_store.counter(ops, self._counters, "bytes_received", started.bytes_received)
            if not isinstance(started.bytes_later, int) or started.bytes_later:
                self.state_store.counter(ops, self._counters, "bytes_sent", started.bytes_later)
            for i, payload in zip(members, received):
                payloads[i] = payload
            if carried is not None:
                flag = carried
        if sent.flag is not None:
            flag = group.synchronize(sent.flag)
        return payloads, flag

    def _collect(self, entries: list[Entry], sent: Sent, tag: str, group: Collectives, ops: Ops,
                 scale: float) -> tuple[list[Tensor], Tensor | None]:
        """The entries' sums over workers times ``scale``, their state writes still pending, and
        the bucket's flag (``_rounds`` run to its end)."""
        return _run_together([self._rounds(entries, sent, tag, group, ops, scale)])[0]

    def _rounds(self, entries: list[Entry], sent: Sent, tag: str, group: Collectives, ops: Ops,
                scale: float) -> Generator[None, None, tuple[list[Tensor], Tensor | None]]:
        """``_collect`` as steps: it pauses each time it has sent a round, so that the buckets of a
        step can each send their next round before any waits for one (``_run_together``). A
        compressor of several rounds computes each next payload from the previous one summed over
        workers (PowerSGD: Q from the summed P); error feedback keeps what this worker's own last
        payload leaves out. Each round is one exchange for the bucket."""
        payloads, flag = self._receive(sent, group, ops)
        step = 1
        while True:
            step += 1
            later = [i for i, e in enumerate(entries) if e.compressor.rounds >= step]
            if not later:
                break
            # The bucket's next payloads at once (only the pipeline's own compressor has more
            # rounds than one): PowerSGD batches its orthogonalizations.
            compressor = entries[later[0]].compressor
            following = compressor.second_rounds([_sum_payloads(payloads[i], ops) for i in later],
                                                 [entries[i].ctx for i in later], ops)
            for i, payload in zip(later, following):
                entry = entries[i]
                entry.payload = payload
                if compressor.rounds == step:
                    with self.state_store.within(entry.transaction):
                        entry.memory.update(entry.compensated, entry.name, compressor, payload,
                                            entry.ctx, ops)
            round_entries = [entries[i] for i in later]
            round_sent = self._send_round(round_entries, f"{tag}.{step}", group, ops, None)
            yield  # the other buckets send theirs while this round travels
            received, _ = self._receive(round_sent, group, ops)
            for i, payload in zip(later, received):
                payloads[i] = payload
                entry = entries[i]
                if entry.compressor.rounds == step:
                    with self.state_store.within(entry.transaction):
                        entry.compressor.after_aggregate(_sum_payloads(payload, ops), entry.ctx, ops)
        totals = []
        for entry, payload in zip(entries, payloads):
            with self.state_store.within(entry.transaction):
                totals.append(entry.compressor.combine(payload, entry.ctx, ops, scale))
        return totals, flag

    def finish(self, pending: Exchange, group: Collectives, scale: float = 1.0) -> Tensor:
        """Wait for the collectives, decompress, aggregate over workers, multiply by ``scale``
        (``1 / size`` to average); the tensor alone is the step (see ``finish_step``)."""
        return self.finish_step([pending], group, scale)[0]

    def finish_step(self, exchanges: Sequence[Exchange], group: Collectives, scale: float = 1.0,
                    carried: Sequence[Tensor] = ()) -> list:
        """``finish`` for every bucket of one step, as one transaction: the state writes of all
        their tensors are kept, or, if any worker's gradient held an Inf or NaN anywhere in the
        step, all dropped and every result made NaN (so a loss scaler skips the step and the state
        is as it was before it). Returns per exchange its tensors' results (the tensor itself for
        one started by ``start``). ``carried``: results the caller combined itself, whose sums
        carry any Inf or NaN into the verdict."""
        if self.hierarchical:
            ops = exchanges[0].ops
            return hierarchy.finish(exchanges, group, scale, list(carried), self._finish_flat,
                                    lambda n: self.state_store.counter(ops, self._counters,
                                                                       "bytes_control", n))
        return self._finish_flat(exchanges, group, scale, carried)

    def _finish_flat(self, exchanges: Sequence[Exchange], group: Collectives, scale: float = 1.0,
                     carried: Sequence[Tensor] = ()) -> list:
        for exchange in exchanges:  # every bucket's second stage in flight before any is awaited
            for communicator, _, started in exchange.sent.groups:
                communicator.relay(started, group, exchange.ops)
        flags, entries = [], []
        # A bucket's later rounds (PowerSGD's second) are sent for every bucket before any is
        # awaited: one bucket's round then travels while the next computes its own, instead of
        # each round trip in turn.
        collected = _run_together([self._rounds(e.live, e.sent, e.tag, group, e.ops, scale)
                                   for e in exchanges])
        for exchange, (totals, flag) in zip(exchanges, collected):
            ops = exchange.ops
            for entry, total in zip(exchange.live, totals):
                entry.result = total
            for entry in exchange.entries:
                if entry.ready is not None:
                    entry.result = entry.ready
            if flag is not None:
                flags.append(flag)
            entries += exchange.entries
        if any(e.transaction is not None or e.deferred is not None for e in entries):
            self._verdict(entries, flags, list(carried), scale, ops)
        return [exchange.results() for exchange in exchanges]

    def _verdict(self, entries: list[Entry], flags: list, carried: list, scale: float,
                 ops: Ops) -> None:
        """Keep or drop every pending state write of the step, by one verdict of all workers."""
                # A tensor combined dense with no state carries its own Inf or NaN in the sum, which every
        # worker sees: it counts towards the verdict without a flag of its own.
        carried += [e.result for e in entries
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
                if isinstance(entry.compressor, RowsCodec):
                    entry.compressor.settle(discard, ops)
                entry.result = ops.nan_if(dropped, entry.result)

    def reduce(self, tensor: Tensor, name: str, group: Collectives, scale: float = 1.0) -> Tensor:
        """``start`` and ``finish`` in one call."""
        return self.finish(self.start(tensor, name, group), group, scale)

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This worker's compression state (residuals, momenta, warm starts, step counters) and
        byte counts: copies, as tensors of the framework that made them (numpy arrays for
        TensorFlow variables). Each worker's state is its own: save it per worker."""
        return {"config": repr(self),
                "compressor": StateStore.export(self.compressor.state()),
                "memory": StateStore.export(self.memory.state()),
                "dense_memory": StateStore.export(self._dense_memory.state()),
                "owner_memory": StateStore.export(self._owner_memory.state()),
                "pipeline": StateStore.export({"exchanges": self._exchanges}),
                "rows": StateStore.export(self._row_stores()),
                "moments": StateStore.export(self._moment_stores()),
                "stats": StateStore.export({"counters": self._counters})["counters"]}

    def load_state_dict(self, state: dict[str, Any], ops: Ops | None = None) -> None:
        """Continue from ``state_dict()``'s result. ``ops`` is the adapter to hold the values (needed
        for TensorFlow, whose state lives in variables; others keep the values as given)."""
        if state.get("config") != repr(self):
            raise ValueError(f"this compression state was saved by {state.get('config')}, not by "
                             f"{self!r}: build the same pipeline before loading it")
        parts = (("compressor", self.compressor.state()), ("memory", self.memory.state()),
                 ("dense_memory", self._dense_memory.state()),
                 ("owner_memory", self._owner_memory.state()), ("pipeline", {"exchanges": self._exchanges}),
                 ("rows", self._row_stores()), ("moments", self._moment_stores()))
        for part, stores in parts:
            for attr, entries in state.get(part, {}).items():
                for name, value in entries.items():
                    StateStore.restore(stores[attr], name, value, ops)
        for key, value in state["stats"].items():
            StateStore.restore(self._counters, key, value, ops)

    def _moment_stores(self) -> dict[str, dict]:
        """Adam's second moment, when taken over."""
        return {} if self._moments is None else self._moments.state()

    def _row_stores(self) -> dict[str, dict]:
        """The sparse gradients' state: residual rows and, when the momentum was taken over,
        velocity rows."""
        return {k: v for part in (self._row_residual, self._row_velocity)
                for k, v in vars(part).items() if isinstance(v, dict)}

    # --- accounting ----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Cumulative for this worker: payload bytes sent into collectives, the bytes the dense
        tensors would have taken, their ratio, how many tensors went through, the bytes of the
        4-byte non-finite flags (``bytes_control``), and the payload bytes received from the other
        workers (``bytes_received``: what they gathered to it, or the sum an allreduce returns).
        With ``hierarchical=True``, those count this worker's exchanges between hosts (the buckets
        it owns), and ``bytes_local`` the dense bytes it put into its host's sums."""
        counts = {key: int(plain(self._counters.get(key, 0)))
                  for key in ("bytes_sent", "bytes_dense", "tensors", "bytes_control",
                              "bytes_received", "bytes_local")}
        sent, dense = counts["bytes_sent"], counts["bytes_dense"]
        counts["compression_ratio"] = dense / sent if sent else float("nan")
        return counts

    def count_control(self, nbytes: int, ops: Ops) -> None:
        """Count a wrapper's own control message (its bytes put into a collective that carries no
        gradient: the PyTorch wrapper's one agreement on which gradients are sparse)."""
        self.state_store.counter(ops, self._counters, "bytes_control", nbytes)

    def reset_stats(self) -> None:
        counters = getattr(self, "_counters", {})
        StateStore.zero_counts(counters)  # in place: a traced function may hold them as variables
        self._counters = counters
