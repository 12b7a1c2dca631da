"""The plan: which route each tensor takes, and which tensors travel together in a bucket. Every
wrapper asks these questions of the pipeline, and every worker gets the same answers from the same
tensors."""

from __future__ import annotations

from enum import Enum
from typing import Sequence

from grace.bucketing import form_buckets
from grace.compressor import Compressor, numel_of
from grace.ops import FLOAT_DTYPES, Ops

GRANULARITIES = ("layer", "bucket")


class Route(str, Enum):
    """How a tensor travels. A string, so that ``route == "dense"`` reads as it did."""

    def __str__(self) -> str:
        return self.value

    EMPTY = "empty"  # nothing to send: it never reaches a collective
    DENSE = "dense"  # allreduce as it is, no memory
    COMPRESSED = "compressed"  # the pipeline's compressor, memory and communicator


class Plan:
    """Tensors the compressor cannot help travel dense: those with fewer than ``min_numel``
    elements, those whose compressed payload would not be smaller than the dense tensor
    (``Compressor.payload_nbytes``), integer and boolean tensors, and shapes the compressor does
    not accept. Buckets hold at most ``bucket_bytes`` dense bytes of tensors of one dtype and
    route (at ``granularity="bucket"`` every float tensor is compressed, joined with the others)."""

    def __init__(self, compressor: Compressor, min_numel: int, granularity: str, bucket_bytes: int):
        self.compressor = compressor
        self.min_numel = min_numel
        self.granularity = granularity
        self.bucket_bytes = bucket_bytes

    def route(self, shape: tuple[int, ...], dtype: str, ops: Ops) -> Route:
        """The route of a tensor of this shape and dtype (the warm-up may still send a compressed
        tensor dense in a given step)."""
        numel = numel_of(shape)
        if numel == 0:
            return Route.EMPTY
        if dtype not in FLOAT_DTYPES or numel < max(self.min_numel, 1):
            return Route.DENSE
        if not self.compressor.accepts(tuple(shape)):
            return Route.DENSE
        itemsize = ops.itemsize(dtype)
        estimate = self.compressor.payload_nbytes(tuple(shape), itemsize)
        return Route.COMPRESSED if estimate is None or estimate < numel * itemsize else Route.DENSE

    def buckets(self, tensors: Sequence[tuple[Sequence[int], str]], ops: Ops) -> list[list[int]]:
        """Positions of ``tensors`` ((shape, dtype) each, in the order they become ready) grouped
        into buckets (``form_buckets``): tensors of one dtype that travel alike, so that each round
        of a bucket is one collective."""
        def kind(shape, dtype):
            if self.granularity == "bucket" and dtype in FLOAT_DTYPES:
                return dtype, "joined"
            return dtype, self.route(tuple(shape), dtype, ops)
        return form_buckets([numel_of(shape) * ops.itemsize(dtype) for shape, dtype in tensors],
                            self.bucket_bytes, [kind(shape, dtype) for shape, dtype in tensors])
