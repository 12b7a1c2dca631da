"""Residual quantization: a codec applied several times, each pass encoding what the passes
before it left, for an owner that must send more levels than the workers' codec has
(``communicator="alltoall"``)."""

from __future__ import annotations

from grace.compressor import Compressor


class Passes(Compressor):
    """``inner`` applied ``count`` times: the first pass encodes the tensor, each further pass
    what the passes before it left (``inner.residual``), and the payload is the passes' payloads
    one after another, decoded as their sum. With 1-bit SGD's two means per block, ``count``
    passes send ``count`` bits per element and ``2 count`` means per block, ``2**count`` levels
    per block placed by the data, where one pass has two. ``inner`` must keep no state of its own
    between encodings (every pass encodes under the same name). Residual binarization as in Guo et
    al., "Network Sketching: Exploiting Binary Structure in Deep CNNs", CVPR 2017."""

    def __init__(self, inner: Compressor, count: int):
        self.inner, self.count = inner, count
        self.name = inner.name

    def _parts(self, payload):
        p = len(payload) // self.count
        return [payload[i * p:(i + 1) * p] for i in range(self.count)]

    def compress_flat(self, flat, name, ctx, ops):
        payload, left = [], flat
        for i in range(self.count):
            part = self.inner.compress_flat(left, name, ctx, ops)
            payload += part
            if i + 1 < self.count:
                left = ops.flatten(self.inner.residual(left, part, ctx, ops))
        return payload

    def decompress_flat(self, payload, ctx, ops):
        return ops.flatten(self.inner.aggregate_payloads(self._parts(payload), ctx, ops))

    def aggregate_payloads(self, payloads, ctx, ops, scale=1.0):
        parts = [part for p in payloads for part in self._parts(p)]
        return self.inner.aggregate_payloads(parts, ctx, ops, scale)

    def residual(self, compensated, payload, ctx, ops, overwrite=False):
        for part in self._parts(payload):
            compensated = self.inner.residual(compensated, part, ctx, ops)
        return compensated

    def payload_nbytes(self, shape, itemsize):
        one = self.inner.payload_nbytes(shape, itemsize)
        return None if one is None else self.count * one

    def __repr__(self):
        return f"Passes({self.inner!r}, {self.count})"
