"""A sparse gradient's rows in a traced graph (TensorFlow's ``tf.function``, Keras's ``fit``),
whose number of rows is known only when the graph runs: grace's ``RowsCodec`` run by numpy then
(``TensorFlowOps.rows_on_host``)."""

from __future__ import annotations

import numpy as np

from grace.backends.numpy_ops import NumpyOps
from grace.ops import Ops, Tensor
from grace.packing import pack_bytes, unpack_bytes
from grace.sparse import RowsCodec, RowStore
from grace.state import plain


class HostRows:
    """A ``RowsCodec``'s work inside a traced graph whose number of rows is known only when it
    runs (TensorFlow's ``tf.function``, Keras's ``fit``): the same algorithm, run by numpy when the
    graph runs (``Ops.on_host``), its payload packed into one byte buffer, its state (residual and
    velocity rows) held as numpy arrays, its writes kept until the step's verdict (``settle``)."""

    def __init__(self, codec: RowsCodec, name: str, rank: int):
        self.ops = NumpyOps()
        self.codec = RowsCodec(codec.inner, True, codec.table, codec.residual_rows, codec.velocity)
        self.codec.state_store = self.state_store = codec.state_store
        self.name, self.rank, self.width = name, rank, codec.width
        self.transactional = codec.transactional
        self.writes: dict | None = None
        self.layout = None
        self.decoded: Tensor | None = None

    def _writes(self) -> dict | None:
        return self.writes if self.transactional else None

    def encode_rows(self, indices: Tensor, rows: Tensor, ops: Ops) -> list:
        def encode(indices, rows):
            _state_on_host(self.codec)
            self.writes = {}
            with self.state_store.within(self._writes()):
                payload, _ = self.codec.encode_rows(indices, rows, self.name, self.ops, self.rank)
            buffer, self.layout = pack_bytes([((0, j), t, True) for j, t in enumerate(payload)],
                                             None, self.ops)
            return [buffer]
        return ops.on_host(encode, [indices, rows], ["uint8"], [[None]])

    def aggregate_payloads(self, payloads, ctx, ops, scale):
        def decode(*buffers):
            parts = [unpack_bytes(b, self.layout, 1, self.ops)[0][0] for b in buffers]
            host_payloads = [[p[(0, j)] for j in range(len(self.layout.parts))] for p in parts]
            host_ctx = self.codec._context(self.name, ctx.dtype, self.rank)
            with self.state_store.within(self._writes()):
                values = self.codec.aggregate_payloads(host_payloads, host_ctx, self.ops, scale)
            return [host_ctx.data["indices"].astype(np.int64), values]
        indices, self.decoded = ops.on_host(decode, [p[0] for p in payloads], ["int64", ctx.dtype],
                                            [[None], [None, self.width]])
        ctx.data["indices"] = indices
        return self.decoded

    def settle(self, discard: Tensor, ops: Ops) -> None:
        if not self.transactional:
            return

        def commit(discard, _):
            self.state_store.commit(self.ops, self.writes, self.ops.is_set(discard))
            return [np.zeros(1, np.float32)]
        # The decoded rows as an input: the commit runs after the decoding's writes.
        ops.on_host(commit, [discard, self.decoded], ["float32"], [[1]])


def _state_on_host(codec: RowsCodec) -> None:
    """The codec's row state as numpy arrays (a checkpoint read into an adapter's tensors)."""
    for part in (codec.residual_rows, codec.velocity):
        for store in ([] if part is None else vars(part).values()):
            if isinstance(store, RowStore):
                for key, value in store.items():
                    if not isinstance(value, np.ndarray):
                        store[key] = np.asarray(plain(value))
