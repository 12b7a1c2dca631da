"""Sparse gradients: the rows of a table that a step touched (an embedding's gradient: PyTorch's
sparse COO tensor, TensorFlow's ``tf.IndexedSlices``), exchanged as rows.

Horovod sends such a gradient as it is: every worker's indices and values, gathered. Here each
worker first adds up the rows of repeated indices (a batch looks up the same word many times), adds
the rows error feedback kept from earlier steps, encodes the rows with the pipeline's compressor
(as one tensor of ``rows × width`` elements: top-k keeps the largest elements of the rows, a
quantizer scales them per block, a cast casts them), and gathers the indices and the encoded rows
from every worker. The receivers decode each worker's rows, add them up per index (or combine them
as the algorithm does: signSGD's majority vote), and hand the optimizer one row per distinct index.

What the encoding leaves out is kept as sparse rows (``RowResidual``): the memory holds the rows
touched, never the table. Where the optimizer's momentum was taken over by the compression, the
rows get it after the exchange (``RowVelocity``), as the optimizer would have applied it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from grace.compressor import Compressor, Context, Sparse, compute_dtype, numel_of
from grace.ops import Ops, Tensor, index_dtype
from grace.state import DEFAULT, StateStore


@dataclass
class Rows:
    """A sparse gradient: ``values[i]`` is the gradient of row ``indices[i]`` of a table of
    ``dense_shape`` (``values`` is 2-d: rows × the row's elements). Indices may repeat."""

    indices: Tensor
    values: Tensor
    dense_shape: tuple[int, ...]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.dense_shape[1:])


def merge(indices: Sequence[Tensor], values: Sequence[Tensor], width: int, ops: Ops
          ) -> tuple[Tensor, Tensor]:
    """The rows (``width`` elements each) of several sparse gradients of one table, one row per
    distinct index (ascending), the rows of an index added up."""
    joined = ops.concat(indices) if len(indices) > 1 else ops.flatten(indices[0])
    rows = values[0] if len(values) == 1 else ops.reshape(ops.concat(values), [-1, width])
    distinct, position = ops.unique(joined)
    return distinct, ops.add_rows(ops.size(distinct), position, rows)


class RowStore(dict):
    """Per-table state whose number of rows changes from step to step (an adapter whose state
    lives in variables gives these a variable first dimension)."""


class RowResidual:
    """Error feedback for sparse gradients: per table, the rows (indices and values) that earlier
    steps' encodings left out, added to the next step's rows before encoding. Only rows that were
    touched are held."""

    state_store: StateStore = DEFAULT

    def __init__(self):
        self.row_indices: dict = RowStore()
        self.row_values: dict = RowStore()

    def compensate(self, indices: Tensor, rows: Tensor, width: int, name: str, ops: Ops
                   ) -> tuple[Tensor, Tensor]:
        kept = self.state_store.load_rows(ops, self.row_indices, self.row_values, name,
                                          like_indices=indices, like=rows)
        if kept is None:
            return indices, rows
        return merge([indices, kept[0]], [rows, kept[1]], width, ops)

    def update(self, indices: Tensor, residual: Tensor, name: str, ops: Ops) -> None:
        self.state_store.save(ops, self.row_indices, name, indices)
        self.state_store.save(ops, self.row_values, name, residual)


class RowVelocity:
    """The optimizer's momentum, taken over by the compression (``grace.momentum``), applied to the
    exchanged rows of a sparse gradient as the optimizer would have: ``u = momentum * u + (1 -
    dampening) * g`` over the rows ever touched (rows not touched this step decay), stepping by
    ``u``, or ``g + momentum * u`` with Nesterov."""

    state_store: StateStore = DEFAULT

    def __init__(self):
        self.momentum = 0.0
        self.nesterov = False
        self.dampening = 0.0
        self.velocity_indices: dict = RowStore()
        self.velocity_values: dict = RowStore()

    def step(self, indices: Tensor, rows: Tensor, width: int, name: str, ops: Ops
             ) -> tuple[Tensor, Tensor]:
        if self.momentum == 0.0:
            return indices, rows if self.dampening == 0.0 else ops.scale(rows, 1.0 - self.dampening)
        kept = self.state_store.load_rows(ops, self.velocity_indices, self.velocity_values, name,
                             like_indices=indices, like=rows)
        fresh = ops.scale(rows, 1.0 - self.dampening) if self.dampening else rows
        if kept is None:
            velocity = (indices, fresh)
        else:
            velocity = merge([indices, kept[0]], [fresh, ops.scale(kept[1], self.momentum)], width, ops)
        self.state_store.save(ops, self.velocity_indices, name, velocity[0])
        self.state_store.save(ops, self.velocity_values, name, velocity[1])
        if self.nesterov:
            return merge([indices, velocity[0]], [rows, ops.scale(velocity[1], self.momentum)], width,
                         ops)
        return velocity


class RowsCodec(Compressor):
    """A sparse gradient's payload: the distinct indices (the narrowest integer that addresses
    the table), then the rows, encoded by ``inner`` where ``encoded`` (else as they are). Decoding
    needs only the payload, whatever the number of rows each worker sent; the workers' rows are
    combined per index as ``inner`` aggregates them, and, if the momentum was taken over, stepped
    by ``velocity``. One codec serves one exchange of one table."""

    name = "rows"
    fixed_size = False

    def __init__(self, inner: Compressor, encoded: bool, table: tuple[int, ...],
                 residual: RowResidual | None, velocity: RowVelocity | None,
                 transactional: bool = True):
        self.inner = inner
        self.encoded = encoded
        self.table = tuple(int(d) for d in table)
        self.width = numel_of(self.table[1:])
        self.residual_rows = residual
        self.velocity = velocity
        self.transactional = transactional
        self.host: Any = None  # its work on the host, in a traced graph (``Ops.rows_on_host``)

    def compress_flat(self, flat, name, ctx, ops):
        raise NotImplementedError("RowsCodec encodes through encode_rows")

    def decompress_flat(self, payload, ctx, ops):
        raise NotImplementedError("RowsCodec decodes through aggregate_payloads")

    def encode_rows(self, indices: Tensor, rows: Tensor, name: str, ops: Ops,
                    rank: int) -> tuple[list, Context]:
        """This worker's payload for the 2-d ``rows`` at ``indices`` (repeats allowed), error
        feedback added before encoding and kept after it (state writes go where
        ``StateStore.within`` routes them)."""
        indices, rows = merge([indices], [rows], self.width, ops)
        if self.encoded and not isinstance(ops.size(indices), int) and not self.inner.elementwise:
            # A traced graph, whose number of rows is known only when it runs: every worker
            # traces the same graph, so every worker encodes on the host alike.
            self.host = ops.rows_on_host(self, name, rank)
            return self.host.encode_rows(indices, rows, ops), self._context(name, ops.dtype(rows), rank)
        if self.encoded and self.residual_rows is not None:
            indices, rows = self.residual_rows.compensate(indices, rows, self.width, name, ops)
        ctx = self._context(name, ops.dtype(rows), rank)
        sent = ops.cast(indices, index_dtype(self.table[0]))
        if not self.encoded:
            return [sent, rows], ctx
        inner_ctx = self._rows_context(ops.size(indices), ops.dtype(rows), rank)
        payload = self.inner.compress_flat(ops.flatten(rows), name, inner_ctx, ops)
        positions = self.inner.sent_indices(payload, inner_ctx)
        if self.residual_rows is not None:
            left = self.inner.residual(rows, payload, inner_ctx, ops, overwrite=True)
            self.residual_rows.update(indices, ops.reshape(left, [-1, self.width]), name, ops)
        if positions is not None and isinstance(self.inner, Sparse):
            sent, payload = self._rows_holding(sent, positions, payload, ops)
        return [sent] + payload, ctx

    def _context(self, name: str, dtype: str, rank: int) -> Context:
        return Context(self.table, dtype, numel_of(self.table), {"name": name}, rank=rank)

    def _rows_context(self, count: Any, dtype: str, rank: int = 0) -> Context:
        """The inner compressor's view of ``count`` rows: a (count, width) tensor (its element
        count 0 where ``count`` is only known when a traced graph runs)."""
        numel = count * self.width
        return Context((count, self.width), dtype, numel if isinstance(numel, int) else 0, rank=rank)

    def _rows_holding(self, sent: Tensor, positions: Tensor, payload: list, ops: Ops
                      ) -> tuple[Tensor, list]:
        """A sparsifier's payload over only the rows that hold a sent entry: their indices, and
        the entries' positions in those rows (a row none of whose entries is sent costs nothing)."""
        row, column = ops.divmod(positions, self.width)
        held, which = ops.unique(row)
        width = ops.full(ops.size(which), self.width, "int64", like=which)
        moved = ops.cast(ops.add(ops.mul(which, width), ops.cast(column, "int64")), ops.dtype(positions))
        return ops.gather(sent, ops.cast(held, "int64")), self.inner.with_positions(payload, moved)

    def _rows_of(self, payload: list, dtype: str, ops: Ops) -> Tensor:
        if not self.encoded:
            return payload[1]
        return self.inner.decompress(payload[1:], self._rows_context(ops.size(payload[0]), dtype), ops)

    def aggregate_payloads(self, payloads, ctx, ops, scale=1.0):
        if self.host is not None:
            return self.host.aggregate_payloads(payloads, ctx, ops, scale)
        work = compute_dtype(ctx.dtype)
        indices = [ops.cast(p[0], "int64") for p in payloads]
        rows = [ops.reshape(ops.cast(self._rows_of(p, ctx.dtype, ops), work), [-1, self.width])
                for p in payloads]
        if not self.encoded or type(self.inner).aggregate is Compressor.aggregate or len(rows) == 1:
            distinct, total = merge(indices, rows, self.width, ops)
        else:  # e.g. a majority vote: each worker's rows aligned on the distinct indices first
            distinct, position = ops.unique(ops.concat(indices))
            count = ops.size(distinct)
            pieces = ops.split(position, [ops.size(i) for i in indices])
            total = self.inner.aggregate(
                [ops.add_rows(count, piece, r) for piece, r in zip(pieces, rows)], ops)
        if scale != 1.0:
            total = ops.scale(total, scale)
        if self.velocity is not None:
            distinct, total = self.velocity.step(distinct, total, self.width, ctx.data["name"], ops)
        ctx.data["indices"] = distinct
        return ops.cast(total, ctx.dtype)

    def settle(self, discard: Tensor, ops: Ops) -> None:
        """The step's verdict for state written on the host (``Ops.rows_on_host``): kept, or dropped
        where ``discard`` is set. Other state writes go through the pipeline's transaction."""
        if self.host is not None:
            self.host.settle(discard, ops)


def payload_bytes_horovod(rows: Rows, ops: Ops) -> Any:
    """What Horovod's own sparse allreduce puts into its allgathers for ``rows``: int64 indices
    and the values as they are."""
    return ops.size(rows.indices) * 8 + ops.size(rows.values) * ops.itemsize(ops.dtype(rows.values))
