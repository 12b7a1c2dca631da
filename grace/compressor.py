"""The ``Compressor`` interface: what every algorithm of the catalogue implements."""

from __future__ import annotations

import functools
import hashlib
import threading
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from grace import steps
from grace.ops import Ops, Tensor, ops_for
from grace.state import DEFAULT, StateStore
from grace.validation import check_int

Payload = list  # list[Tensor]: what goes into the collectives, in a fixed order

MODELS = {"mnist-sgd": "the mnist MLP with SGD and momentum", "mnist-adam": "the mnist MLP with Adam",
          "cnn-sgd": "a small CNN with SGD and momentum", "cnn-adam": "a small CNN with Adam",
          "lstm-sgd": "a character LSTM with plain SGD",
          "words-sgd": "a word model with a sparse embedding and plain SGD"}
"""The quality benchmark's models and optimizers (docs/quality.md), as ``Compressor.shortfalls``
names them."""


@dataclass
class Context:
    """What stays on the worker between compress and decompress: the tensor's shape and dtype, and
    whatever the algorithm needs to rebuild it (e.g. random-k's indices, which are never sent)."""

    shape: tuple[int, ...]
    dtype: str
    numel: int
    data: dict[str, Any] = field(default_factory=dict)
    rank: int = 0  # the worker's rank: stochastic compressors draw differently on each worker


TINY = 2.0**-149
"""The smallest positive float32 (a subnormal): the floor of a divisor that may be 0, low enough
that tensors of subnormal values still divide by their own scale."""


def stable_seed(*parts: Any) -> int:
    """A 64-bit seed from the parts' text (Python's ``hash`` differs between processes)."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


DEFAULT_MIN_NUMEL = 1024
"""Tensors with fewer elements (biases, norms) travel dense: compressing them saves little and adds
latency. Override with ``min_numel=``."""

DECODING_METHODS = ("decompress", "decompress_flat", "aggregate", "aggregate_payloads")
"""What turns payloads into the result: a subclass that defines one of them decodes its own way
(``Compressor.decodes_by_cast`` is then false unless it says otherwise). A subclass written with a
former name (``decode``, ``combine``) defines the new one too (``__init_subclass__``)."""


LENGTH_BYTES = 4
"""Each tensor of a variable-size payload travels with its length, an int32 (``Allgather``)."""


def payload_budget(numel: int, itemsize: int, parts: int) -> int:
    """The most bytes a variable-size payload of ``parts`` tensors may fill, its lengths included,
    and still be smaller than the dense tensor of ``numel`` elements of ``itemsize`` bytes."""
    return numel * itemsize - LENGTH_BYTES * parts - 1


def at_least_bytes(nbytes, limit: int, ops, like) -> Tensor:
    """``not_smaller``'s answer, from an encoded size (an int, or a scalar tensor in a traced
    graph): a 1-element float32 tensor, 1 where ``nbytes >= limit``."""
    if isinstance(nbytes, int):
        return ops.constant([1.0 if nbytes >= limit else 0.0], "float32", like=like)
    return ops.reshape(ops.cast(ops.greater_equal(nbytes, limit), "float32"), [1])


def capped(x, indices, cap: int, ops):
    """``indices`` (into the 1-d ``x``), or, if there are more than ``cap``, the ``cap`` of them
    where ``|x|`` is largest: how a sparsifier whose count depends on the data keeps its payload
    under the dense tensor's size (error feedback keeps the rest). In ascending order, as
    ``nonzero`` gives them, so that every framework sends the same payload."""
    if cap <= 0:
        return ops.zeros(0, ops.dtype(indices), like=indices)
    return ops.cond(ops.size(indices) > cap,
                    lambda: ops.sort(ops.gather(indices, ops.topk_indices(ops.gather(x, indices), cap))),
                    lambda: indices)


def zero_sent(compensated: Tensor, sent: Tensor, payload: Payload, ctx: Context, ops: Ops,
              overwrite: bool = False) -> Tensor:
    """The residual of a payload whose entries at ``sent`` (flat positions) travel as they are:
    ``compensated`` with those entries zeroed, in one copy, or in none with ``overwrite``
    (``compensated`` is not used afterwards, and the payload holds copies of its entries)."""
    return ops.reshape(ops.zero_at(ops.flatten(compensated), sent, overwrite,
                                   after=[p for p in payload if p is not sent]),
                       ctx.shape)


def numel_of(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def compute_dtype(dtype: str) -> str:
    """Arithmetic on 16-bit gradients runs in float32; the payload keeps the gradient's dtype."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


RENAMED_PARAMS = {"bucket_size": "block_size", "buckets": "bins"}
"""Compressor parameters that were renamed: former name -> name. The former is still taken, with a
warning once per process (``renamed``), and a checkpoint whose configuration reads with it still
loads (``Pipeline.load_state_dict``)."""

RENAMED_MEANING = {"block_size": "the blocks of consecutive elements that share a scale",
                   "bins": "the value ranges a sketch sends each element as the id of"}
"""What each renamed parameter names, for the warning a former name gets."""

_warned_renamed: set[str] = set()


def _warn_once(former: str, message: str, stacklevel: int) -> None:
    """``message`` as a ``FutureWarning`` the first time this process meets the former name
    ``former`` (a parameter's or a method's); ``stacklevel`` as the caller would give it."""
    if former not in _warned_renamed:
        _warned_renamed.add(former)
        warnings.warn(message, FutureWarning, stacklevel=stacklevel + 1)


def renamed(new: str, value: Any, former: Any, unset: Any) -> Any:
    """The value of the parameter ``new``, which may have been given by its former name
    (``former``, ``None`` where it was not): the former value, with a ``FutureWarning`` the first
    time; both given with different values is an error naming both. ``unset``: ``new``'s default."""
    old = next(key for key, value_ in RENAMED_PARAMS.items() if value_ == new)
    if former is None:
        return value
    if value != unset and value != former:
        raise ValueError(f"{new}={value!r} and its former name {old}={former!r} are both given; "
                         f"give {new} only")
    _warn_once(old, f"grace: the parameter {old} is now called {new} ({RENAMED_MEANING[new]}; a "
                    f"bucket is the tensors that travel together): {old}={former!r} is taken as "
                    f"{new}={former!r}", stacklevel=3)
    return former


RENAMED_METHODS = {"encode": "compress_flat", "decode": "decompress_flat",
                   "combine": "aggregate_payloads", "decoded_residual": "residual"}
"""Former names of ``Compressor`` methods (each was a near-synonym of another method), and the
name each now has. A subclass written against a former name, and a caller of one, still work,
with one ``FutureWarning`` a process."""


def _warn_renamed_method(former: str, where: str) -> None:
    _warn_once(former, f"grace: Compressor.{former} is now called {RENAMED_METHODS[former]} "
                       f"({where}); the former name will go in a later release", stacklevel=4)


_running_former = threading.local()
"""``stack``: (class, instance) of each former-named method running in this thread, innermost last,
so that its ``super().encode(...)`` reaches its parent's ``compress_flat``, not its own again."""


def _former_method(cls: type, function: Any) -> Any:
    """``function``, a method ``cls`` defines under a former name, recording while it runs that a
    former method of ``cls`` is running on this instance."""
    @functools.wraps(function)
    def method(self, *args, **kwargs):
        stack = _running_former.__dict__.setdefault("stack", [])
        stack.append((cls, self))
        try:
            return function(self, *args, **kwargs)
        finally:
            stack.pop()
    return method


def _call_renamed(self: "Compressor", former: str, *args: Any) -> Any:
    """A call of the former name ``former``: the current method, or, where a former-named method
    of a subclass calls it through ``super()``, the method its parent has under the current name."""
    _warn_renamed_method(former, "called")
    stack = getattr(_running_former, "stack", None)
    new = RENAMED_METHODS[former]
    if stack and stack[-1][1] is self:
        return getattr(super(stack[-1][0], self), new)(*args)
    return getattr(self, new)(*args)


def _residual_from(decoded_residual: Any) -> Any:
    """``residual`` of a subclass that defines the former ``decoded_residual``: its own for a
    payload that does not send entries as they are, as that name meant."""
    def residual(self, compensated, payload, ctx, ops, overwrite=False):
        sent = self.sent_indices(payload, ctx)
        if sent is not None:
            return zero_sent(compensated, sent, payload, ctx, ops, overwrite)
        return decoded_residual(self, compensated, payload, ctx, ops, overwrite)
    return residual


class Compressor(ABC):
    """Turns a gradient into a payload of (few) tensors and back.

    ``compress(tensor, name)`` returns ``(payload, ctx)``; ``decompress(payload, ctx)`` rebuilds a tensor
    of the original shape and dtype. ``aggregate`` combines the decompressed tensors of all workers
    (a sum, unless the algorithm says otherwise). An algorithm implements ``compress_flat`` and
    ``decompress_flat``, the same on the 1-d tensor; ``aggregate_payloads`` (the workers'
    payloads decompressed and aggregated, in one pass where it can) and ``residual`` (what error
    feedback keeps) have general definitions that an algorithm may do faster. They work on any
    tensor type ``ops_for`` knows, so a user can study a compressor on a numpy array or a torch
    tensor outside of training.

    Class attributes state how payloads may travel:

    - ``summable``: the payloads of different workers can be added element-wise and decompressed once
      (their layouts agree), which makes ``allreduce`` a valid communicator.
    - ``fixed_size``: the payload's sizes depend only on the tensor's size, so receivers can split a
      gathered payload without being told the lengths.
    - ``default_memory`` / ``default_communicator``: what the paper uses, by registry name.
    - ``default_warmup_steps``: dense exchanges before compression starts, where measured to help.
    - ``default_min_numel``: tensors with fewer elements travel dense (``DEFAULT_MIN_NUMEL``); 0
      for fp16, whose cast costs nothing per tensor joined with its bucket and halves even a bias.
    - ``agrees_on_form``: the encoded size depends on the data and may exceed the dense tensor's;
      the workers then agree each step whether all send it encoded or all dense (``not_smaller``).
    - ``rounds``: 2 for a compressor whose payload takes two trips (PowerSGD: P, then Q); it then
      implements ``second_round`` and may implement ``after_aggregate``.
    - ``encodes_rows``: it can encode the rows of a sparse gradient (``grace.sparse``), whose
      number differs between workers and steps: decoding needs only the payload and the size, and
      no state has the tensor's shape. False for PowerSGD (a matrix every worker shares), random-k
      (indices drawn alike on every worker) and signum (a momentum per tensor): their sparse
      gradients travel as rows as they are.
    - ``elementwise``: it encodes each element on its own (a cast), so it works on tensors whose
      size is only known when a traced graph runs.
    - ``layout_sensitive``: what it makes of a tensor depends on which elements lie next to each
      other (blocks of consecutive elements with a scale each, a matrix view). A framework whose
      layers store their weights in another order than PyTorch's hands it those weights'
      gradients in PyTorch's order (TensorFlow: Keras's kernels output-major,
      ``frameworks/tensorflow/layout.py``), so that it compresses the same groups of elements
      in both.
    - ``sends_exactly``: as a shard owner's codec, it carries the combination it is given exactly
      (signSGD's votes), so that the owners' second encoding loses nothing without a residual.
    - ``adam_caution``: where the compressor is measured to fall short of uncompressed training with
      Adam, what the wrapper tells a user who wraps Adam (logged once, on rank 0), else ``None``.
    - ``owners_caution``: where the owners' second encoding of its combined payloads
      (``communicator="alltoall"``) is measured to cost accuracy that gathering keeps, why, else
      ``None``; ``communicator="auto"`` then gathers its payloads at any size.
    - ``shortfalls``: the models of the quality benchmark (``MODELS``) on which the compressor at
      its defaults is measured short of its target (data/quality/safety.md), each with what was
      measured, why where known, and the setting that works there; the wrapper says them in one
      line on rank 0 as it is built (``shortfall_notice``).
    - ``keeps_nonfinite``: every Inf or NaN of the tensor decodes to an Inf or NaN in its place,
      and a finite value to a finite one or to Inf (``none``; a cast, where a value beyond the
      wire's range overflows), so a sum of payloads carries any Inf or NaN to every worker.
    - ``decodes_by_cast``: its payload is one tensor whose decoding is a cast to the tensor's
      dtype (``none``, a cast), so the workers' summed payload decodes straight into a tensor the
      caller gives over (``aggregate_into``).
    - ``can_take_second_moment``: its payload can carry Adam's second moment beside the values
      (random-k, ``grace.second_moment``).
    """

    name: ClassVar[str] = "abstract"
    summable: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    default_memory: ClassVar[str] = "none"
    default_communicator: ClassVar[str] = "allreduce"
    default_warmup_steps: ClassVar[int] = 0
    default_min_numel: ClassVar[int] = DEFAULT_MIN_NUMEL
    agrees_on_form: ClassVar[bool] = False
    rounds: ClassVar[int] = 1
    encodes_rows: ClassVar[bool] = True
    elementwise: ClassVar[bool] = False
    layout_sensitive: ClassVar[bool] = False
    adam_caution: ClassVar[str | None] = None
    owners_caution: ClassVar[str | None] = None
    shortfalls: ClassVar[dict[str, str]] = {}
    sends_exactly: ClassVar[bool] = False
    keeps_nonfinite: ClassVar[bool] = False
    can_take_second_moment: ClassVar[bool] = False
    decodes_by_cast: ClassVar[bool] = False
    state_store: StateStore = DEFAULT
    """Where state kept across steps is read and written (``grace.state``): the pipeline's own."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A subclass written against a former method name (RENAMED_METHODS) implements the new one.
        super().__init_subclass__(**kwargs)
        for former, new in RENAMED_METHODS.items():
            if former in vars(cls) and new not in vars(cls):
                method = _former_method(cls, vars(cls)[former])
                setattr(cls, former, method)
                setattr(cls, new, _residual_from(method) if former == "decoded_residual" else method)
                _warn_renamed_method(former, f"{cls.__name__} defines {former}")
        # A subclass of a cast that decodes or sums otherwise, without saying it still decodes by
        # a cast, is not one: ``aggregate_into`` would skip its own decoding.
        if "decodes_by_cast" not in vars(cls) and any(m in vars(cls) for m in DECODING_METHODS):
            cls.decodes_by_cast = False

    def encode(self, flat: Tensor, name: str, ctx: Context, ops: Ops) -> Payload:
        """Former name of ``compress_flat``."""
        return _call_renamed(self, "encode", flat, name, ctx, ops)

    def decode(self, payload: Payload, ctx: Context, ops: Ops) -> Tensor:
        """Former name of ``decompress_flat``."""
        return _call_renamed(self, "decode", payload, ctx, ops)

    def combine(self, payloads: Sequence[Payload], ctx: Context, ops: Ops,
                scale: float = 1.0) -> Tensor:
        """Former name of ``aggregate_payloads``."""
        return _call_renamed(self, "combine", payloads, ctx, ops, scale)

    def decoded_residual(self, compensated: Tensor, payload: Payload, ctx: Context, ops: Ops,
                         overwrite: bool = False) -> Tensor:
        """Former name of the general ``residual`` of a payload that does not send entries as
        they are: ``compensated - decompress(payload)``."""
        _warn_renamed_method("decoded_residual", "called")
        return ops.sub(compensated, self.decompress(payload, ctx, ops))

    def compress(self, tensor: Tensor, name: str, ops: Ops | None = None,
                 rank: int = 0) -> tuple[Payload, Context]:
        ops = ops or ops_for(tensor)
        ctx = Context(ops.shape(tensor), ops.dtype(tensor), ops.numel(tensor), rank=rank)
        return self.compress_flat(ops.flatten(tensor), name, ctx, ops), ctx

    def decompress(self, payload: Sequence[Tensor], ctx: Context, ops: Ops | None = None) -> Tensor:
        ops = ops or ops_for(payload[0])
        return ops.reshape(self.decompress_flat(list(payload), ctx, ops), ctx.shape)

    @abstractmethod
    def compress_flat(self, flat: Tensor, name: str, ctx: Context, ops: Ops) -> Payload:
        """Compress the 1-d ``flat`` (``ctx`` describes the original); may store what decode needs in
        ``ctx.data``."""

    @abstractmethod
    def decompress_flat(self, payload: Payload, ctx: Context, ops: Ops) -> Tensor:
        """Rebuild the 1-d tensor of ``ctx.numel`` elements of ``ctx.dtype``."""

    def aggregate(self, tensors: Sequence[Tensor], ops: Ops) -> Tensor:
        """Combine the decompressed tensors of all workers into their sum."""
        total = tensors[0]
        for t in tensors[1:]:
            total = ops.add(total, t)
        return total

    def aggregate_payloads(self, payloads: Sequence[Payload], ctx: Context, ops: Ops,
                           scale: float = 1.0) -> Tensor:
        """The workers' payloads (one per worker, or one already summed), decompressed,
        aggregated and multiplied by ``scale``: ``aggregate`` of each one's ``decompress`` (an
        algorithm may do it in one pass over the tensor)."""
        total = self.aggregate([self.decompress(p, ctx, ops) for p in payloads], ops)
        return ops.scale(total, scale) if scale != 1.0 else total

    def aggregate_into(self, payloads: Sequence[Payload], ctx: Context, ops: Ops, scale: float,
                       out: Tensor | None) -> Tensor:
        """``aggregate_payloads``, written into ``out`` (the tensor's own memory, which the
        caller reads no more) where the payload is one summed tensor that decodes by a cast
        (``decodes_by_cast``): one pass into it instead of a new tensor per decoding and scaling
        (``Ops.scale_into``). The same bits either way."""
        if out is not None and self.decodes_by_cast and len(payloads) == 1 and len(payloads[0]) == 1:
            return ops.scale_into(payloads[0][0], scale, out)
        return self.aggregate_payloads(payloads, ctx, ops, scale)

    def payload_nbytes(self, shape: tuple[int, ...], itemsize: int) -> int | None:
        """The payload's size in bytes for a tensor of this shape, when known in advance, or an upper
        bound for a payload whose size varies (used to leave a tensor dense where compression would
        not shrink it); ``None`` if unknown."""
        return None

    def residual(self, compensated: Tensor, payload: Payload, ctx: Context, ops: Ops,
                 overwrite: bool = False) -> Tensor:
        """What error feedback keeps: ``compensated - decompress(payload)``; for a payload of
        entries sent as they are (``sent_indices``), the compensated tensor with those entries
        zeroed (``zero_sent``). An algorithm that finds the difference in fewer passes overrides
        it (``tests/test_one_pass.py`` checks every one against this definition)."""
        sent = self.sent_indices(payload, ctx)
        if sent is not None:
            return zero_sent(compensated, sent, payload, ctx, ops, overwrite)
        return ops.sub(compensated, self.decompress(payload, ctx, ops))

    def sent_indices(self, payload: Payload, ctx: Context) -> Tensor | None:
        """For a sparsifier that sends some entries exactly as they are: their (distinct) indices
        in the flattened tensor; ``None`` for any other payload."""
        return None

    def not_smaller(self, flat: Tensor, ctx: Context, ops: Ops) -> Tensor:
        """For ``agrees_on_form``: a 1-element float32 tensor, 1 where the encoding of the 1-d
        ``flat``, its lengths included, might not be smaller than the dense tensor, else 0 (an
        upper bound of the encoded size will do; it decides before anything is encoded)."""
        raise NotImplementedError

    def owner_codec(self) -> "Compressor":
        """What encodes a shard's combined value again at its owner (``communicator="alltoall"``):
        this compressor, unless its aggregate is something it cannot encode (a majority vote)."""
        return self

    def notice(self) -> str | None:
        """A sentence saying how this compressor, as built, departs from what the user set (e.g. a
        floor under ``ratio``), for the wrapper to log once on rank 0; ``None`` when it does not."""
        return None

    def shortfall_notice(self) -> str | None:
        """The line the wrapper logs once on rank 0 where this compressor, at its defaults, is
        measured short of its quality target on some model (``shortfalls``), else ``None``."""
        if not self.shortfalls:
            return None
        found = "; ".join(f"on {MODELS[case]}, {what}" for case, what in self.shortfalls.items())
        return (f"grace: {self.name} at its defaults is measured short of uncompressed training "
                f"{found} (data/quality/safety.md)")

    def learning_rate_notice(self, lr: float | None, optimizer_momentum: float = 0.0) -> str | None:
        """Where this compressor needs a learning rate far from ``lr`` (the optimizer's at its first
        step; ``None`` where no optimizer is seen), the sentence the wrapper logs once on rank 0
        with the rate that works; ``optimizer_momentum``: the momentum the optimizer still applies."""
        return None

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Whether this algorithm applies to a tensor of this shape (PowerSGD needs a matrix)."""
        return True

    def second_round(self, aggregated: Payload, ctx: Context, ops: Ops) -> Payload:
        """For ``rounds == 2``: from the first round's payload summed over workers, this worker's
        second payload (``decompress`` of it is this worker's own approximation)."""
        raise NotImplementedError

    def second_rounds(self, aggregated: Sequence[Payload], ctxs: Sequence[Context],
                      ops: Ops) -> list[Payload]:
        """``second_round`` for the tensors of one bucket at once, so that an algorithm can batch
        the work (PowerSGD orthogonalizes its matrices of one shape in one call). Like
        ``second_round`` it writes no state."""
        return [self.second_round(a, ctx, ops) for a, ctx in zip(aggregated, ctxs)]

    def after_aggregate(self, aggregated: Payload, ctx: Context, ops: Ops) -> None:
        """Called with the last round's payload summed over workers (e.g. to keep a warm start)."""

    def state(self) -> dict[str, dict]:
        """The state this compressor keeps between steps (step counters of its seeds, momenta, warm
        starts): its dict attributes, each keyed by tensor name."""
        return {k: v for k, v in vars(self).items() if isinstance(v, dict)}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({params})"

    def params(self) -> dict[str, Any]:
        """The constructor's parameters, as given."""
        return {}


class Sparse:
    """For a sparsifier whose payload's first tensor holds values of some entries (at
    ``positions``; the payload's second tensor by default): decoding scatters the values, the
    residual zeroes the sent entries (``sent_indices``), and the workers' payloads are summed by
    one scatter of all their entries, scaled before it: one pass over the tensor instead of one
    per worker, an addition and a scaling."""

    def positions(self, payload, ctx):
        """The indices of the entries whose values ``payload[0]`` holds."""
        return payload[1]

    def with_positions(self, payload, positions):
        """``payload`` with its values at ``positions`` instead (the same values, another tensor's
        layout: a sparse gradient's rows sends only the rows that hold a value)."""
        return [payload[0], positions, *payload[2:]]

    def decompress_flat(self, payload, ctx, ops):
        return ops.scatter_add(ctx.numel, self.positions(payload, ctx), payload[0])

    def sent_indices(self, payload, ctx):
        return self.positions(payload, ctx)

    def aggregate_payloads(self, payloads, ctx, ops, scale=1.0):
        values = [p[0] for p in payloads]
        positions = [self.positions(p, ctx) for p in payloads]
        values = ops.concat(values) if len(values) > 1 else values[0]
        positions = ops.concat(positions) if len(positions) > 1 else positions[0]
        if scale != 1.0:  # the values scaled, not the tensor they are scattered into
            values = ops.scale(values, scale)
        return ops.reshape(ops.scatter_add(ctx.numel, positions, values), ctx.shape)


class Tabled:
    """For a compressor whose payload decodes through a small table per block of elements (1-bit
    SGD's two means, EF-signSGD's ±scale, QSGD's levels): ``tables`` gives the packed codes and
    the tables, and decoding, the residual and the sum over workers each take one pass over the
    tensor. The residual decodes onto the compensated tensor through the negated tables (``x +
    (-t)`` is ``x - t`` exactly); the workers' payloads decode one onto the other, each table
    scaled first (a few values per block, not the tensor)."""

    def tables(self, payload, ctx, ops) -> tuple[Tensor, int, Tensor, int]:
        """(the packed codes, bits per code, the tables (blocks, 2**bits) in ``ctx.dtype``, the
        block's size)."""
        raise NotImplementedError

    def decompress_flat(self, payload, ctx, ops):
        packed, bits, tables, block = self.tables(payload, ctx, ops)
        return steps.unpack_blocks(ops, packed, tables, bits=bits, n=ctx.numel, block=block)

    def residual(self, compensated, payload, ctx, ops, overwrite=False):
        packed, bits, tables, block = self.tables(payload, ctx, ops)
        left = steps.unpack_blocks_onto(ops, packed, ops.scale(tables, -1.0), ops.flatten(compensated),
                                        bits=bits, n=ctx.numel, block=block)
        return ops.reshape(left, ctx.shape)

    def aggregate_payloads(self, payloads, ctx, ops, scale=1.0):
        total = None
        for payload in payloads:
            packed, bits, tables, block = self.tables(payload, ctx, ops)
            if scale != 1.0:
                tables = ops.scale(tables, scale)
            total = (steps.unpack_blocks(ops, packed, tables, bits=bits, n=ctx.numel, block=block)
                     if total is None else
                     steps.unpack_blocks_onto(ops, packed, tables, total, bits=bits, n=ctx.numel,
                                              block=block))
        return ops.reshape(total, ctx.shape)


class Seeded:
    """For compressors that draw random numbers: a ``seed`` and a per-tensor step counter, and draws
    from private generators seeded by (seed, tensor name, step, and the worker's rank unless the
    workers must agree). Counters are state (``state()`` sees ``_steps``)."""

    def _init_seed(self, seed: int) -> None:
        self.seed = check_int("seed", seed, minimum=0)
        self._steps: dict = {}

    def params(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def _seed_of(self, name: str, ctx: Context, shared: bool):
        if shared:
            return lambda step: stable_seed(self.seed, name, step)
        return lambda step: stable_seed(self.seed, name, step, ctx.rank)

    def next_step(self, name: str, ops: Ops) -> Any:
        return self.state_store.counter(ops, self._steps, name)

    def uniform(self, n: int, name: str, ctx: Context, ops: Ops, like: Tensor, step: Any = None):
        """``n`` float32 draws from [0, 1), different on each worker."""
        step = self.next_step(name, ops) if step is None else step
        return ops.random_uniform(n, self._seed_of(name, ctx, shared=False), step, like=like)

    def indices(self, n: int, k: int, name: str, ctx: Context, ops: Ops, like: Tensor,
                step: Any = None, shared: bool = False):
        """``k`` distinct indices in ``[0, n)``; ``shared=True``: the same on every worker."""
        step = self.next_step(name, ops) if step is None else step
        return ops.random_indices(n, k, self._seed_of(name, ctx, shared), step, like=like)
