"""The per-tensor pipeline a factory such as ``grace.topk(0.01)`` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from grace.collectives import Collectives
from grace.communicator import Communicator
from grace.communicators.allreduce import Allreduce
from grace.compressor import Compressor, Context, numel_of
from grace.compressors.none import NoneCompressor
from grace.memories.momentum import MomentumMemory
from grace.memories.none import NoneMemory
from grace.memory import Memory
from grace.momentum import OptimizerMomentum, owner
from grace.ops import FLOAT_DTYPES, Ops, Tensor, ops_for


@dataclass
class Pending:
    """One tensor between ``Pipeline.start`` and ``Pipeline.finish``."""

    name: str
    ctx: Context
    compressor: Compressor
    communicator: Communicator
    handle: Any
    ops: Ops
    ready: Tensor | None = None  # set when nothing had to travel (empty tensors)
    memory: Memory | None = None
    compensated: Tensor | None = None  # kept for a second round (PowerSGD)
    nonfinite: Any = None  # handle of the allreduced "some worker's tensor is not finite" flag
    transaction: dict | None = None  # this tensor's state writes, committed with the step's verdict
    deferred: Any = None  # traced warm-up: f(discard, scale) -> the result, run once the verdict is known


def _copy(value: Any) -> Any:
    if hasattr(value, "clone"):  # torch
        return value.clone()
    if hasattr(value, "assign"):  # a TensorFlow variable
        return value.numpy()
    return ops_for(value).copy(value) if hasattr(value, "shape") else value


def _copy_stores(stores: dict[str, dict]) -> dict[str, dict]:
    return {attr: {name: _copy(v) for name, v in entries.items()} for attr, entries in stores.items()}


def _restore(store: dict, key: str, value: Any, ops: Ops | None) -> None:
    if ops is not None:
        ops.save(store, key, value)
    elif hasattr(store.get(key), "assign"):
        store[key].assign(value)
    else:
        store[key] = _copy(value)


def _sum_payloads(payloads: list, ops: Ops) -> list:
    """Per-worker payloads added component by component (a single one is returned as it is)."""
    total = list(payloads[0])
    for payload in payloads[1:]:
        total = [ops.add(a, b) for a, b in zip(total, payload)]
    return total


class Pipeline:
    """Compression of gradients, one tensor at a time, in the order error feedback requires:

    ``memory.compensate`` → ``compressor.compress`` → ``memory.update`` → ``communicator.start`` …
    ``communicator.finish`` → ``compressor.decompress`` → ``compressor.aggregate`` → scale.

    Tensors the compressor cannot help travel dense through allreduce, with no memory: those with
    fewer than ``min_numel`` elements, those whose compressed payload would not be smaller than the
    dense tensor, and integer or boolean tensors. Empty tensors never reach a collective.

    Non-finite gradients (``check_finite``, on by default): with each compressed tensor a 4-byte
    flag is allreduced (a tensor that travels dense carries its own Inf or NaN into the sum), and
    the state writes (residuals, momenta, counters) stay pending until the step is decided
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

    This object is what a Horovod script passes as ``compression=``; the framework wrappers drive
    ``start`` and ``finish`` from their hooks.
    """

    def __init__(self, compressor: Compressor, memory: Memory, communicator: Communicator,
                 min_numel: int = 0, check_finite: bool = True, warmup_steps: int = 0):
        communicator.bind(compressor)
        self.compressor = compressor
        self.memory = memory
        self.communicator = communicator
        self.min_numel = min_numel
        self.check_finite = check_finite
        self.warmup_steps = warmup_steps
        self._exchanges: dict = {}  # per tensor: how many exchanges the warm-up has counted
        self._dense_compressor = NoneCompressor()
        self._dense_memory = NoneMemory()
        self._dense_communicator = Allreduce()
        self.reset_stats()

    def __repr__(self) -> str:
        dense = "" if isinstance(self._dense_memory, NoneMemory) else f", dense_memory={self._dense_memory!r}"
        return (f"Pipeline(compressor={self.compressor!r}, memory={self.memory!r}{dense}, "
                f"communicator={self.communicator!r}, min_numel={self.min_numel}, "
                f"check_finite={self.check_finite}, warmup_steps={self.warmup_steps})")

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
        applies momentum itself, if there is one; the caller then sets the optimizer's to 0. The
        tensors that travel dense get ``found`` from here on, applied before the exchange, so that
        every tensor keeps the momentum the optimizer gave it. Returns the sentence to log once, or
        ``None`` when nothing was taken (``adam``: ``found`` is Adam's ``beta_1``, taken only by the
        algorithms that ask for it). See ``grace.momentum``."""
        part = owner(self)
        if part is None or found.momentum == 0.0 or (adam and not part.takes_adam_beta1):
            return None
        part.take_momentum(found)
        dense = MomentumMemory(found.momentum, found.nesterov, found.dampening)
        if isinstance(part, MomentumMemory) and part.momentum_params() == dense.momentum_params():
            # One velocity per tensor: a warm-up's dense steps build what compression continues.
            dense.velocities = part.velocities
        self._dense_memory = dense
        return part.takeover_line(found, self.compressor.name)

    # --- the pipeline --------------------------------------------------------------------------
    def compresses(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> bool:
        """Whether a tensor of this shape and dtype is compressed, or travels dense."""
        numel = numel_of(shape)
        if dtype not in FLOAT_DTYPES or numel < max(self.min_numel, 1):
            return False
        if not self.compressor.accepts(tuple(shape)):
            return False
        itemsize = ops.itemsize(dtype)
        estimate = self.compressor.payload_nbytes(tuple(shape), itemsize)
        return estimate is None or estimate < numel * itemsize

    def travels_as_is(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> bool:
        """Whether a (non-empty) tensor of this shape and dtype is simply allreduced, with no state
        and no flag: a framework wrapper may then hand it to its own in-place allreduce, after
        ``count_as_is``."""
        if numel_of(shape) == 0:
            return False
        if not self.compresses(shape, dtype, ops):
            return self._carries_nonfinite(self._dense_compressor, self._dense_memory,
                                           self._dense_communicator)
        return self._carries_nonfinite(self.compressor, self.memory, self.communicator)

    def count_as_is(self, numel: int, itemsize: int, ops: Ops) -> None:
        """The byte counts of a tensor a wrapper allreduced itself (see ``travels_as_is``)."""
        for key in ("bytes_sent", "bytes_dense"):
            ops.counter(self._counters, key, numel * itemsize)
        ops.counter(self._counters, "tensors")

    def start(self, tensor: Tensor, name: str, group: Collectives, ops: Ops | None = None) -> Pending:
        """Compress ``tensor`` (with error feedback) and start its collectives."""
        ops = ops or ops_for(tensor)
        shape, numel, dtype = ops.shape(tensor), ops.numel(tensor), ops.dtype(tensor)
        if numel == 0:
            ctx = Context(shape, dtype, 0)
            return Pending(name, ctx, self._dense_compressor, self._dense_communicator, None, ops,
                           ready=ops.copy(tensor))
        if not self.compresses(shape, dtype, ops):
            return self._start(tensor, name, group, ops, dense=True)
        if self.warmup_steps:
            # Read here; counted with the step's other state writes, so a skipped step undoes it.
            exchange = ops.counter(self._exchanges, name, 0)
            if not isinstance(exchange, int):
                return self._start_traced_warmup(tensor, name, group, ops, exchange)
            return self._start(tensor, name, group, ops, dense=exchange < self.warmup_steps, count=True)
        return self._start(tensor, name, group, ops, dense=False)

    def _start_traced_warmup(self, tensor, name, group, ops, exchange) -> Pending:
        """In a traced graph the exchange count is only known when the graph runs: both ways are
        built, and the count picks one then. The state written inside a branch must be committed
        there, so the branch runs once the step's verdict is known (``finish_step``); this tensor's
        own non-finite flag is allreduced before it, for that verdict."""
        shape, numel, dtype = ops.shape(tensor), ops.numel(tensor), ops.dtype(tensor)
        nonfinite = self._flag(tensor, name, group, ops) if self.check_finite else None

        def deferred(discard, scale):
            def way(dense):
                pending = self._start(tensor, name, group, ops, dense=dense, flag=False)
                total = self._collect(pending, group, scale)
                if pending.transaction is None:
                    return total
                return ops.nan_if(ops.commit(pending.transaction, discard), total)
            result = ops.cond(exchange < self.warmup_steps, lambda: way(True), lambda: way(False))
            counted: dict | None = {} if self.check_finite else None
            with ops.within(counted):
                ops.counter(self._exchanges, name)
            if counted is not None:
                ops.commit(counted, discard)
            return result

        return Pending(name, Context(shape, dtype, numel), self._dense_compressor,
                       self._dense_communicator, None, ops, nonfinite=nonfinite, deferred=deferred)

    def _flag(self, tensor, name, group, ops):
        """Start the allreduce of this worker's 'tensor is not finite' flag."""
        flag = ops.nonfinite_flag(tensor)
        ops.counter(self._counters, "bytes_control", ops.nbytes(flag))
        return group.allreduce_async(flag, f"grace.{name}.nonfinite")

    def _start(self, tensor, name, group, ops, dense: bool, flag: bool = True,
               count: bool = False) -> Pending:
        """Start one tensor's exchange, dense or compressed; ``flag``: allreduce its non-finite flag
        (unless its sum carries any Inf itself); ``count``: count the exchange for the warm-up."""
        numel, dtype = ops.numel(tensor), ops.dtype(tensor)
        if dense:
            compressor, memory, communicator = (self._dense_compressor, self._dense_memory,
                                                self._dense_communicator)
        else:
            compressor, memory, communicator = self.compressor, self.memory, self.communicator
        nonfinite = transaction = None
        carries = self._carries_nonfinite(compressor, memory, communicator)
        if self.check_finite and (count or not carries):
            nonfinite = self._flag(tensor, name, group, ops) if flag and not carries else None
            transaction = {}
        agree = not dense and compressor.agrees_on_form
        with ops.within(transaction):
            if count:
                ops.counter(self._exchanges, name)
            compensated = memory.compensate(tensor, name, ops)
            if not agree:
                payload, ctx = compressor.compress(compensated, name, ops, rank=group.rank)
        ops.counter(self._counters, "bytes_dense", numel * ops.itemsize(dtype))
        ops.counter(self._counters, "tensors")
        if agree:
            return self._agree_on_form(compensated, name, group, ops, nonfinite, transaction)
        return self._send_payload(compressor, memory, communicator, compensated, payload, ctx, name,
                                  group, ops, nonfinite, transaction)

    def _send_payload(self, compressor, memory, communicator, compensated, payload, ctx, name, group,
                      ops, nonfinite, transaction) -> Pending:
        with ops.within(transaction):
            if compressor.rounds == 1:
                memory.update(compensated, name, compressor, payload, ctx, ops)
        handle = self._send(communicator, payload, f"grace.{name}", group, ops)
        return Pending(name, ctx, compressor, communicator, handle, ops, memory=memory,
                       compensated=compensated if compressor.rounds == 2 else None,
                       nonfinite=nonfinite, transaction=transaction)

    def _agree_on_form(self, compensated, name, group, ops, nonfinite, transaction):
        """For a compressor whose encoded size depends on the data (``agrees_on_form``): the
        workers agree, by one 4-byte allreduce, whether every one of them sends its encoded
        payload (each, lengths included, smaller than the tensor) or all send the tensor dense
        through allreduce (exactly the dense bytes). Deciding alone, a worker would have to say which
        form it sent, in bytes beyond the dense tensor's. Each worker's vote comes from the tensor,
        before it is encoded (``Compressor.not_smaller``), so a dense step encodes nothing."""
        ctx = Context(ops.shape(compensated), ops.dtype(compensated), ops.numel(compensated),
                      rank=group.rank)
        flat = ops.flatten(compensated)
        local = self.compressor.not_smaller(flat, ctx, ops)
        ops.counter(self._counters, "bytes_control", ops.nbytes(local))
        agreed = ops.dropped(group.synchronize(group.allreduce_async(local, f"grace.{name}.form")))

        def way(dense, transaction):
            if dense:
                return self._send_payload(self._dense_compressor, self.memory, self._dense_communicator,
                                          compensated, [flat], ctx, name, group, ops, nonfinite,
                                          transaction)
            with ops.within(transaction):
                payload, encoded = self.compressor.compress(compensated, name, ops, rank=group.rank)
            return self._send_payload(self.compressor, self.memory, self.communicator, compensated,
                                      payload, encoded, name, group, ops, nonfinite, transaction)

        if isinstance(agreed, bool):
            return way(agreed, transaction)

        def deferred(discard, scale):  # a traced graph: the agreement is known when it runs
            def run(dense):
                writes = None if transaction is None else dict(transaction)  # each branch its own
                pending = way(dense, writes)
                total = self._collect(pending, group, scale)
                return total if writes is None else ops.nan_if(ops.commit(writes, discard), total)
            return ops.cond(agreed, lambda: run(True), lambda: run(False))

        return Pending(name, ctx, self.compressor, self.communicator, None, ops, nonfinite=nonfinite,
                       deferred=deferred)

    @staticmethod
    def _carries_nonfinite(compressor, memory, communicator) -> bool:
        """A tensor allreduced as it is, with no state, needs no flag: an Inf or NaN on any worker
        is in the sum every worker receives, and there is nothing to roll back."""
        return (isinstance(compressor, NoneCompressor) and isinstance(memory, NoneMemory)
                and isinstance(communicator, Allreduce))

    def _send(self, communicator, payload, name, group, ops):
        ops.counter(self._counters, "bytes_sent", communicator.bytes_sent(payload, group, ops))
        return communicator.start(payload, name, group, ops)

    def finish(self, pending: Pending, group: Collectives, scale: float = 1.0) -> Tensor:
        """Wait for the collectives, decompress, aggregate over workers, multiply by ``scale``
        (``1 / size`` to average); the tensor alone is the step (see ``finish_step``)."""
        return self.finish_step([pending], group, scale)[0]

    def finish_step(self, pendings: Sequence[Pending], group: Collectives, scale: float = 1.0,
                    carried: Sequence[Tensor] = ()) -> list[Tensor]:
        """``finish`` for every tensor of one step, as one transaction: the state writes of all of
        them are kept, or, if any worker's gradient held an Inf or NaN anywhere in the step, all
        dropped and every result made NaN (so a loss scaler skips the step and the state is as it
        was before it). ``carried``: results the caller combined itself (Horovod's own allreduce),
        whose sums carry any Inf or NaN into the verdict."""
        results: dict[int, Tensor] = {}
        flags = []
        for i, pending in enumerate(pendings):
            if pending.deferred is None:
                results[i] = self._collect(pending, group, scale)
            if pending.nonfinite is not None:
                flags.append(group.synchronize(pending.nonfinite))
        if not any(p.transaction is not None or p.deferred is not None for p in pendings):
            return [results[i] for i in range(len(pendings))]
        ops = pendings[0].ops
        # A tensor combined dense carries its own Inf or NaN in the sum, which every worker sees: it
        # counts towards the verdict without a flag of its own.
        carried = list(carried) + [results[i] for i, p in enumerate(pendings)
                                   if p.deferred is None and p.nonfinite is None and p.ready is None]
        discard = flags[0] if flags else ops.zeros(1, "float32", like=carried[0])
        for part in flags[1:] + [ops.nonfinite_flag(t) for t in carried]:
            discard = ops.add(discard, part)
        for i, pending in enumerate(pendings):
            if pending.deferred is not None:
                results[i] = pending.deferred(discard, scale)
        dropped = ops.dropped(discard)
        for pending in pendings:
            if pending.transaction is not None:
                ops.commit(pending.transaction, discard)
        return [results[i] if p.deferred is not None else ops.nan_if(dropped, results[i])
                for i, p in enumerate(pendings)]

    def _collect(self, pending: Pending, group: Collectives, scale: float) -> Tensor:
        """The tensor's sum over workers times ``scale``, its state writes still pending."""
        if pending.ready is not None:
            return pending.ready
        ops, compressor, ctx = pending.ops, pending.compressor, pending.ctx
        payloads = pending.communicator.finish(pending.handle, group, ops)
        if compressor.rounds == 2:
            # The second payload is computed from the first one summed over workers; error feedback
            # keeps what this worker's own second payload leaves out.
            with ops.within(pending.transaction):
                local = compressor.second_round(_sum_payloads(payloads, ops), ctx, ops)
                pending.memory.update(pending.compensated, pending.name, compressor, local, ctx, ops)
            handle = self._send(pending.communicator, local, f"grace.{pending.name}.2", group, ops)
            payloads = pending.communicator.finish(handle, group, ops)
            with ops.within(pending.transaction):
                compressor.after_aggregate(_sum_payloads(payloads, ops), ctx, ops)
        with ops.within(pending.transaction):
            decompressed = [compressor.decompress(p, ctx, ops) for p in payloads]
            total = compressor.aggregate(decompressed, ops)
        return ops.scale(total, scale) if scale != 1.0 else total

    def reduce(self, tensor: Tensor, name: str, group: Collectives, scale: float = 1.0) -> Tensor:
        """``start`` and ``finish`` in one call."""
        return self.finish(self.start(tensor, name, group), group, scale)

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This worker's compression state (residuals, momenta, warm starts, step counters) and
        byte counts: copies, as tensors of the framework that made them (numpy arrays for
        TensorFlow variables). Each worker's state is its own: save it per worker."""
        return {"config": repr(self),
                "compressor": _copy_stores(self.compressor.state()),
                "memory": _copy_stores(self.memory.state()),
                "dense_memory": _copy_stores(self._dense_memory.state()),
                "pipeline": _copy_stores({"exchanges": self._exchanges}),
                "stats": _copy_stores({"counters": self._counters})["counters"]}

    def load_state_dict(self, state: dict[str, Any], ops: Ops | None = None) -> None:
        """Continue from ``state_dict()``'s result. ``ops`` is the adapter to hold the values (needed
        for TensorFlow, whose state lives in variables; others keep the values as given)."""
        if state.get("config") != repr(self):
            raise ValueError(f"this compression state was saved by {state.get('config')}, not by "
                             f"{self!r}: build the same pipeline before loading it")
        parts = (("compressor", self.compressor.state()), ("memory", self.memory.state()),
                 ("dense_memory", self._dense_memory.state()), ("pipeline", {"exchanges": self._exchanges}))
        for part, stores in parts:
            for attr, entries in state[part].items():
                for name, value in entries.items():
                    _restore(stores[attr], name, value, ops)
        for key, value in state["stats"].items():
            _restore(self._counters, key, value, ops)

    # --- accounting ----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Cumulative for this worker: payload bytes sent into collectives, the bytes the dense
        tensors would have taken, their ratio, how many tensors went through, and the bytes of the
        4-byte non-finite flags (``bytes_control``)."""
        counts = {key: int(Ops.value_of(self._counters.get(key, 0)))
                  for key in ("bytes_sent", "bytes_dense", "tensors", "bytes_control")}
        sent, dense = counts["bytes_sent"], counts["bytes_dense"]
        counts["compression_ratio"] = dense / sent if sent else float("nan")
        return counts

    def reset_stats(self) -> None:
        counters = getattr(self, "_counters", {})
        for key, value in counters.items():
            # Counters may be variables that a traced function updates: reset them in place.
            if hasattr(value, "assign"):
                value.assign(0)
            else:
                counters[key] = 0
        self._counters = counters
