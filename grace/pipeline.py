"""The pipeline a factory such as ``grace.topk(0.01)`` returns: compression with error feedback,
and the fused exchange of buckets of tensors."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from grace import checkpoint, hierarchy, joining
from grace.bucketing import DEFAULT_BUCKET_BYTES, bucket_tag
from grace.collectives import Collectives, sums_fused
from grace.communicator import Communicator
from grace.communicators.alltoall import Sharding
from grace.compressor import Compressor
from grace.encoding import Encoding, takes_overwrite
from grace.exchange import Exchange
from grace.memory import Memory
from grace.momentum import OptimizerMomentum
from grace.ops import Ops, Tensor, ops_for
from grace.plan import GRANULARITIES, Plan, Route
from grace.rounds import Rounds, run_together
from grace.row_exchange import RowExchange
from grace.sparse import Rows
from grace.state import StateStore, plain
from grace.takeover import Takeover
from grace.transaction import StepTransaction, flag_of
from grace.warmup import Warmup

__all__ = ["GRANULARITIES", "Pipeline", "Route", "takes_overwrite"]


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

    Warm-up (``warmup_steps``, ``grace.warmup``): the first ``warmup_steps`` exchanges of each
    tensor travel dense (allreduce, no memory, counted in ``stats()`` as dense bytes sent).

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
        self.hierarchical = hierarchical
        self.built_while_tracing = next(
            (site for site in (where() for where in BUILT_WHILE_TRACING) if site is not None), None)
        """Where the user's code built it inside a function being traced (Horovod's examples
        build their compression inside the ``tf.function`` step), else ``None``: the framework's
        wrapper shares the one pipeline that line builds among the traces
        (``frameworks/tensorflow/keras3.py``)."""
        self.state_store = StateStore()
        """This pipeline's state and its step's transaction (``grace.state``), which every part
        it drives reads and writes through."""
        self._counters: dict = {}
        # The parts, each one job: the plan, the takeover, the rounds engine, the transaction, the
        # warm-up, the sparse rows, the shard owners, the encoding (docs/architecture.md). The
        # settings a part uses live in it (``min_numel`` in the plan, ...): the pipeline's
        # attributes of the same names read and set them there.
        self.planner = Plan(compressor, min_numel, granularity, bucket_bytes)
        self.takeover = Takeover(compressor, memory, communicator, keep_optimizer, self._own)
        """What the pipeline takes over from the wrapped optimizer (``grace.takeover``)."""
        self.rounds = Rounds(self.state_store, self._counters)
        self.transaction = StepTransaction(self.state_store)
        self.warmup = Warmup(warmup_steps, self.state_store)
        self.rows = RowExchange(compressor, memory, self.planner, self.takeover, self.warmup,
                                self.rounds, self.state_store, self._counters, check_finite, self._own)
        """Sparse gradients exchanged as rows (``start_sparse``)."""
        self.sharding = Sharding(compressor, memory, communicator, self.rows.communicator, self._own)
        """The shard owners' codecs and error feedback (``communicator="alltoall"``)."""
        self.encoding = Encoding(compressor, memory, communicator, self.planner, self.takeover,
                                 self.warmup, self.sharding, self.rounds, self.transaction,
                                 self.state_store, self._counters, check_finite)
        """Each entry's way this step, error feedback around the codec, the vote on its form."""
        self._own(compressor, memory, self.encoding.dense_compressor, self.sharding.owner_memory)
        self.reset_stats()

    min_numel = property(lambda self: self.planner.min_numel,
                         lambda self, value: setattr(self.planner, "min_numel", value),
                         doc="Tensors with fewer elements travel dense (``Plan``).")
    granularity = property(lambda self: self.planner.granularity,
                           lambda self, value: setattr(self.planner, "granularity", value),
                           doc="``layer``: each tensor compressed alone; ``bucket``: joined.")
    bucket_bytes = property(lambda self: self.planner.bucket_bytes,
                            lambda self, value: setattr(self.planner, "bucket_bytes", value),
                            doc="Dense bytes per bucket (``Plan.buckets``).")
    warmup_steps = property(lambda self: self.warmup.steps,
                            lambda self, value: setattr(self.warmup, "steps", value),
                            doc="Exchanges of each tensor sent dense first (``Warmup``).")
    keep_optimizer = property(lambda self: self.takeover.keep_optimizer,
                              lambda self, value: setattr(self.takeover, "keep_optimizer", value),
                              doc="Leave the wrapped optimizer as the user set it: take neither its "
                                  "momentum nor Adam's moments over; a part that applies momentum "
                                  "itself applies only what it was given.")

    @property
    def check_finite(self) -> bool:
        """Whether a step with an Inf or NaN in any worker's gradient is dropped by every worker
        (``StepTransaction``), which the encoding and the rows' exchange prepare for."""
        return self.encoding.check_finite

    @check_finite.setter
    def check_finite(self, value: bool) -> None:
        self.encoding.check_finite = self.rows.check_finite = value

    def _own(self, *parts: Any) -> None:
        """Give ``parts`` this pipeline's state store."""
        for part in parts:
            part.state_store = self.state_store

    @property
    def _dense_memory(self) -> Memory:
        """The memory of the tensors that travel dense: the momentum taken over, if any."""
        return self.encoding.dense_memory

    def __repr__(self) -> str:
        dense = "" if self._dense_memory.stateless else f", dense_memory={self._dense_memory!r}"
        moments = self.takeover.moments
        return (f"Pipeline(compressor={self.compressor!r}, memory={self.memory!r}{dense}, "
                f"communicator={self.communicator!r}, min_numel={self.min_numel}, "
                f"check_finite={self.check_finite}, warmup_steps={self.warmup_steps}, "
                f"granularity={self.granularity!r}, bucket_bytes={self.bucket_bytes}"
                + (", hierarchical=True" if self.hierarchical else "")
                + (", keep_optimizer=True" if self.keep_optimizer else "")
                + (f", adam={moments!r})" if moments is not None else ")"))

    # --- what Horovod's own optimizer would call -----------------------------------------------
    def compress(self, tensor):
        raise TypeError(
            "a grace pipeline reached Horovod's own DistributedOptimizer, which can only allreduce. "
            "Import grace before calling hvd.DistributedOptimizer (grace routes it), or use "
            "frameworks.torch.DistributedOptimizer / frameworks.tensorflow.DistributedGradientTape."
        )

    decompress = compress

    # --- the optimizer takeover (``grace.takeover``): what the wrappers ask ----------------------
    def take_momentum(self, found: OptimizerMomentum, adam: bool = False) -> str | None:
        """``Takeover.take_momentum``: the optimizer's momentum to the part that applies it."""
        return self.takeover.take_momentum(found, adam)

    def retake_momentum(self, found: OptimizerMomentum) -> None:
        """``Takeover.retake_momentum``: the momentum taken, as the optimizer now says it."""
        self.takeover.retake_momentum(found)

    def take_adam_moments(self, beta2: float, eps: float, averaged: bool = True) -> str | None:
        """``Takeover.take_adam_moments``: Adam's moments, for random-k, on the plain route (tensor
        by tensor, not hierarchical, no warm-up). Its compressed tensors then come out of the
        exchange as the update the wrapper steps itself (``steps_itself``)."""
        plain_route = self.granularity == "layer" and not self.hierarchical and not self.warmup_steps
        return self.takeover.take_adam_moments(beta2, eps, averaged, plain_route)

    @property
    def adam_moments_taken(self) -> bool:
        """Whether ``take_adam_moments`` took them (once, for every wrapper of this pipeline)."""
        return self.takeover.moments is not None

    def adam_caution(self, optimizer: str) -> str | None:
        """``Takeover.adam_caution``: the line to log once where the compressor falls short with
        Adam."""
        return self.takeover.adam_caution(optimizer)

    def notices(self, size: int, optimizer_seen: bool = True,
                wrapper: str = "DistributedGradientTape") -> list[str]:
        """``Takeover.notices``: the sentences a wrapper logs once on rank 0 when it is built for
        a job of ``size`` workers."""
        return self.takeover.notices(size, optimizer_seen, wrapper)

    def steps_itself(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> bool:
        """Whether a tensor of this shape and dtype comes out of the exchange as the update that
        the wrapper steps by the learning rate (Adam's moments taken over, ``take_adam_moments``),
        rather than as the gradient for the optimizer."""
        return self.adam_moments_taken and self.plan(tuple(shape), dtype, ops) == Route.COMPRESSED

    # --- the plan (``grace.plan``): what travels how ------------------------------------------------
    def plan(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> Route:
        """How a tensor of this shape and dtype travels (``Plan.route``): ``Route.EMPTY``,
        ``DENSE`` (allreduce, no memory) or ``COMPRESSED``. Every wrapper asks this one question;
        the warm-up may still send a compressed tensor dense in a given step."""
        return self.planner.route(shape, dtype, ops)

    def compresses(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> bool:
        """Whether a tensor of this shape and dtype is compressed, or travels dense."""
        return self.plan(shape, dtype, ops) == Route.COMPRESSED

    def buckets(self, tensors: Sequence[tuple[Sequence[int], str]], ops: Ops) -> list[list[int]]:
        """Positions of ``tensors`` ((shape, dtype) each, in the order they become ready) grouped
        into buckets of at most ``bucket_bytes`` dense bytes (``Plan.buckets``). Every worker forms
        the same buckets from the same tensors."""
        return self.planner.buckets(tensors, ops)

    @property
    def starts_waiting(self) -> bool:
        """Whether starting a bucket waits for the other workers: a vote on the payload's form
        (``agrees_on_form``), or the host's dense sum (``hierarchical``). Such a start must come in
        the same order on every worker, which backward's hooks do not promise (a worker whose graph
        skips a parameter completes its buckets in another order, or in ``synchronize``)."""
        return self.hierarchical or self.compressor.agrees_on_form

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
        return self.rows.start(rows, name, group, ops)

    def start_bucket(self, tensors: Sequence[Tensor], names: Sequence[str], group: Collectives,
                     ops: Ops | None = None, overwrite: bool = False, lent: bool = False
                     ) -> Exchange:
        """Compress a bucket of tensors and start its exchange: one collective per kind of payload
        (summed: one per dtype; gathered: one) for all of them, the non-finite flag inside. At
        ``granularity="bucket"`` the bucket's float tensors of one dtype are compressed as one
        vector. Every worker starts the same buckets, in the same order. ``overwrite``: the caller
        reads the tensors no more (gradients the exchange's results replace, as Horovod's
        allreduce writes over them), so error feedback adds its residual into them instead of
        into a full-size tensor of its own each step; the values computed are the same. ``lent``
        (with ``overwrite``): the tensors' memory is the caller's again once the step is over (DDP
        fills its bucket anew each step), so it is written into within the step (sums in place)
        but never kept as compression state: error feedback keeps its residual in a tensor of its
        own. (With ``hierarchical=True`` the host's sums are compressed, tensors of the pipeline's
        own.)"""
        ops = ops or ops_for(tensors[0])
        if self.hierarchical:  # dense within the host, compressed between hosts (grace.hierarchy)
            return hierarchy.start(tensors, names, group, ops, self._start_flat,
                                   lambda n: self.state_store.counter(ops, self._counters,
                                                                      "bytes_local", n))
        return self._start_flat(tensors, names, group, ops, overwrite, lent)

    def _start_flat(self, tensors: Sequence[Tensor], names: Sequence[str], group: Collectives,
                    ops: Ops, overwrite: bool = False, lent: bool = False) -> Exchange:
        tag = bucket_tag(names)
        # Collectives that fuse sums themselves leave an element-wise codec's tensors apart.
        join_alike = not sums_fused(group) and self._joins_alike()
        entries = joining.entries(list(tensors), list(names), ops, self.granularity, join_alike,
                                  lambda shape, dtype: self.plan(shape, dtype, ops),
                                  overwrite=overwrite, lent=lent)
        for entry in entries:
            self.encoding.prepare(entry, group, ops)
        self.encoding.vote(entries, tag, group, ops)
        live = [e for e in entries if e.payload is not None]
        sent = self.rounds.send(live, tag, group, ops, flag_of(entries, ops))
        return Exchange(tag, entries, len(tensors), ops, live, sent)

    def _joins_alike(self) -> bool:
        """Whether a bucket's tensors may be encoded as one vector at ``granularity="layer"`` (the
        other granularity joins them anyway), with the same bits as one by one: an element-wise
        codec (a cast, or none) that keeps no state (no memory, no momentum taken over, no warm-up
        to count per tensor), summed by allreduce. Then each kind of tensor costs one encoding,
        one flag and one decoding per bucket instead of per tensor: on a GPU, a dozen kernel
        launches per tensor (docs/performance.md)."""
        return (self.granularity == "layer" and self.compressor.elementwise
                and self.memory.stateless and self.communicator.sums
                and self.takeover.taken is None and self.takeover.moments is None
                and not self.warmup_steps)

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
        collected = run_together([self.rounds.run(e.live, e.sent, e.tag, group, e.ops, scale)
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
            self.transaction.decide(entries, flags, list(carried), scale, ops)
        return [exchange.results() for exchange in exchanges]

    def reduce(self, tensor: Tensor, name: str, group: Collectives, scale: float = 1.0) -> Tensor:
        """``start`` and ``finish`` in one call."""
        return self.finish(self.start(tensor, name, group), group, scale)

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This worker's compression state (residuals, momenta, warm starts, step counters) and
        byte counts: copies, as tensors of the framework that made them (numpy arrays for
        TensorFlow variables). Each worker's state is its own: save it per worker."""
        return checkpoint.save(repr(self), self._state_parts(), self._counters)

    def load_state_dict(self, state: dict[str, Any], ops: Ops | None = None) -> None:
        """Continue from ``state_dict()``'s result. ``ops`` is the adapter to hold the values (needed
        for TensorFlow, whose state lives in variables; others keep the values as given)."""
        checkpoint.load(state, repr(self), self._state_parts(), self._counters, ops)

    def _state_parts(self) -> dict[str, dict[str, dict]]:
        """The stores of every part that keeps state, by the name a checkpoint saves them under:
        the sparse gradients' residual rows (and velocity rows, the momentum taken over) and
        Adam's second moment (taken over) among them."""
        moments = self.takeover.moments
        return {"compressor": self.compressor.state(), "memory": self.memory.state(),
                "dense_memory": self._dense_memory.state(),
                "owner_memory": self.sharding.owner_memory.state(),
                "pipeline": {"exchanges": self.warmup.exchanges},
                "rows": {k: v for part in (self.rows.residual, self.takeover.row_velocity)
                         for k, v in vars(part).items() if isinstance(v, dict)},
                "moments": {} if moments is None else moments.state()}

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
