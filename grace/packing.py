"""A bucket's payloads in one buffer per collective, and back again.

Payloads that are summed (``Allreduce``: dense tensors, summable payloads) are joined per dtype into
one tensor each (one dtype in practice, so one allreduce). Payloads that are gathered (``Allgather``)
travel as their bytes in one uint8 buffer per worker: first the int32 lengths of every part whose
size depends on the data, then the parts. The step's 4-byte non-finite flag rides in one of these
buffers instead of a collective of its own: as one more element of a float sum, or as 4 bytes of
each worker's gathered buffer, which the receiver adds up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from grace.compressor import LENGTH_BYTES
from grace.ops import FLOAT_DTYPES, Ops, Tensor

FLAG_DTYPE = "float32"
Key = tuple  # (entry, part): which entry of the bucket, which tensor of its payload


@dataclass
class SumLayout:
    """Where each summed part sits: per buffer its dtype and its parts' keys and sizes, and which
    buffer ends with the flag."""

    buffers: list[tuple[str, list[tuple[Key, int]]]] = field(default_factory=list)
    flag_buffer: int | None = None
    made: list[bool] = field(default_factory=list)  # per buffer: a tensor joined here, not a part

    @property
    def flag_dtype(self) -> str | None:
        return None if self.flag_buffer is None else self.buffers[self.flag_buffer][0]


def pack_sums(parts: Sequence[tuple[Key, Tensor]], flag: Tensor | None, ops: Ops,
              alone_from: int | None = None) -> tuple[list[Tensor], SumLayout]:
    """The buffers to allreduce: ``parts`` joined per dtype, ``flag`` appended to a float one;
    parts of ``alone_from`` bytes or more, where given, each a buffer of its own."""
    layout, buffers = SumLayout(), []
    by_dtype: dict[str, list[tuple[Key, Tensor]]] = {}
    for key, tensor in parts:
        numel = ops.static_numel(tensor) if alone_from is not None else None
        if numel is not None and numel * ops.itemsize(ops.dtype(tensor)) >= alone_from:
            buffers.append(ops.flatten(tensor))
            layout.buffers.append((ops.dtype(tensor), [(key, ops.numel(tensor))]))
            layout.made.append(False)
        else:
            by_dtype.setdefault(ops.dtype(tensor), []).append((key, tensor))
    floats = [d for d in by_dtype if d in FLOAT_DTYPES]
    flag_dtype = None
    if flag is not None:
        flag_dtype = FLAG_DTYPE if FLAG_DTYPE in by_dtype or not floats else floats[0]
        by_dtype.setdefault(flag_dtype, [])
    for dtype, members in by_dtype.items():
        tensors = [ops.flatten(t) for _, t in members]
        if dtype == flag_dtype:
            # Summed over workers the flag counts the workers with a non-finite gradient (exact in
            # any float dtype for any real worker count, 16-bit ones included up to 256).
            tensors.append(ops.cast(flag, dtype))
            layout.flag_buffer = len(buffers)
        buffers.append(tensors[0] if len(tensors) == 1 else ops.concat(tensors))
        layout.buffers.append((dtype, [(key, ops.numel(t)) for key, t in members]))
        layout.made.append(len(tensors) > 1)
    return buffers, layout


def unpack_sums(buffers: Sequence[Tensor], layout: SumLayout, ops: Ops
                ) -> tuple[dict[Key, Tensor], Tensor | None]:
    """The summed parts by key, and the summed flag (float32, 1 element) or ``None``."""
    parts, flag = {}, None
    for i, (buffer, (_, members)) in enumerate(zip(buffers, layout.buffers)):
        sizes = [n for _, n in members]
        if i == layout.flag_buffer:
            sizes.append(1)
        pieces = ops.split(ops.flatten(buffer), sizes) if len(sizes) > 1 else [ops.flatten(buffer)]
        for (key, _), piece in zip(members, pieces):
            parts[key] = piece
        if i == layout.flag_buffer:
            flag = ops.cast(pieces[-1], FLAG_DTYPE)
    return parts, flag


@dataclass
class ByteLayout:
    """Each gathered part's key, dtype and size (``None``: read from the lengths header), and
    whether the flag follows the header."""

    parts: list[tuple[Key, str, int | None]] = field(default_factory=list)
    flagged: bool = False

    @property
    def header_bytes(self) -> int:
        return LENGTH_BYTES * sum(1 for _, _, n in self.parts if n is None) + (4 if self.flagged else 0)


def pack_bytes(parts: Sequence[tuple[Key, Tensor, bool]], flag: Tensor | None, ops: Ops
               ) -> tuple[Tensor, ByteLayout]:
    """This worker's buffer to allgather: (key, tensor, whether its size varies) for each part."""
    layout = ByteLayout(flagged=flag is not None)
    head, body = [], []
    variable = [t for _, t, varies in parts if varies]
    if variable:
        head.append(ops.to_bytes(ops.lengths(variable)))
    if flag is not None:
        head.append(ops.to_bytes(ops.cast(flag, FLAG_DTYPE)))
    for key, tensor, varies in parts:
        layout.parts.append((key, ops.dtype(tensor), None if varies else ops.numel(tensor)))
        body.append(ops.to_bytes(tensor))
    pieces = head + body
    return (pieces[0] if len(pieces) == 1 else ops.concat(pieces)), layout


def packed_bytes(parts: Sequence[tuple[Key, Tensor, bool]], ops: Ops) -> Any:
    """The payload bytes of ``pack_bytes``' buffer, lengths included, the flag not."""
    return sum(ops.nbytes(t) + (LENGTH_BYTES if varies else 0) for _, t, varies in parts)


def unpack_bytes(gathered: Tensor, layout: ByteLayout, workers: int, ops: Ops
                 ) -> tuple[list[dict[Key, Tensor]], Tensor | None]:
    """Every worker's parts by key, in rank order, and the flag summed over workers. Each worker's
    buffer is read at the offset where the previous one ended (its length follows from its
    header)."""
    per_worker, flags = [], []
    offset: Any = 0
    n_variable = sum(1 for _, _, n in layout.parts if n is None)
    for _ in range(workers):
        at = offset
        lengths = None
        if n_variable:
            lengths = ops.from_bytes(ops.slice(gathered, at, LENGTH_BYTES * n_variable), "int32")
            at = at + LENGTH_BYTES * n_variable
        if layout.flagged:
            flags.append(ops.from_bytes(ops.slice(gathered, at, 4), FLAG_DTYPE))
            at = at + 4
        parts, variable_index = {}, 0
        for key, dtype, n in layout.parts:
            if n is None:
                n = _element(lengths, variable_index, ops)
                variable_index += 1
            nbytes = n * ops.itemsize(dtype)
            parts[key] = ops.from_bytes(ops.slice(gathered, at, nbytes), dtype)
            at = at + nbytes
        per_worker.append(parts)
        offset = at
    flag = None
    if flags:
        flag = flags[0]
        for f in flags[1:]:
            flag = ops.add(flag, f)
    return per_worker, flag


def _element(lengths: Tensor, i: int, ops: Ops) -> Any:
    """Element ``i`` of a 1-d int32 tensor: an int where the values are at hand, else a scalar
    tensor (a traced graph)."""
    value = ops.slice(lengths, i, 1)
    try:
        return int(ops.to_numpy(value)[0])
    except (AttributeError, NotImplementedError):  # symbolic: known only when the graph runs
        return ops.reshape(ops.cast(value, "int64"), [])
