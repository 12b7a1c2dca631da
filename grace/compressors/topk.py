from __future__ import annotations

from grace.compressor import Compressor, Sparse, numel_of
from grace.ops import index_dtype
from grace.validation import check_ratio

MIN_KEPT = 16
"""The fewest entries a magnitude sparsifier sends of a tensor (all of a smaller one). At 0.1% a
1,280-element layer would send one entry per step, each accumulating ~1,000 steps of residual:
measured, DGC then diverges on an MLP whose output layer is that size, and trains with 16. Sixteen
values and indices (128 bytes) cost no more time than one: a collective's fixed latency dominates
payloads of a few kilobytes."""


def kept(ratio: float, numel: int) -> int:
    """How many entries a sparsifier keeps at ``ratio``: ``ratio * numel``, at least ``MIN_KEPT``,
    at most ``numel``."""
    return min(numel, max(MIN_KEPT, int(ratio * numel)))


class TopK(Sparse, Compressor):
    """Top-k sparsification: each worker sends the ``k = max(16, int(ratio * numel))`` entries of
    largest magnitude (``kept``) as (values, int32 indices) and drops the rest, which error
    feedback (the ``residual`` memory) adds back into later steps. Workers pick different indices,
    so payloads are gathered, not summed, and the receivers add them up; through the shards'
    owners an owner keeps the top ``owner_ratio`` of its shard's sum (``ratio`` by default). Aji &
    Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017; Stich et al.,
    "Sparsified SGD with Memory", NeurIPS 2018."""

    name = "topk"
    default_memory = "residual"
    default_communicator = "allgather"
    owner_ratio: float | None = None

    def __init__(self, ratio: float = 0.01, owner_ratio: float | None = None):
        self.ratio = check_ratio("ratio", ratio)
        self.owner_ratio = None if owner_ratio is None else check_ratio("owner_ratio", owner_ratio)

    def params(self):
        # owner_ratio only where set: a default top-k reads (and checkpoints) as it always has.
        return {"ratio": self.ratio} | ({} if self.owner_ratio is None else {"owner_ratio": self.owner_ratio})

    def owner_codec(self):
        """Through the shards' owners (``communicator="alltoall"``) an owner keeps the top
        ``owner_ratio`` of its shard's sum (``ratio`` unless set). Gathering applies the union of
        every worker's ``k`` entries, up to ``n k``; on mnist at 4 workers owners keeping ``k`` of
        the sum end 0.96 point below it (8 simulated seeds; 0.39 in 4 real runs), keeping ``2 k``
        (``owner_ratio=2 * ratio``) 0.20 (0.12), for half again the second stage's bytes
        (docs/results.md, "Eight seeds at 4 workers, and four real ones")."""
        return self if self.owner_ratio is None else TopK(self.owner_ratio)

    def k(self, numel: int) -> int:
        return kept(self.ratio, numel)

    def encode(self, flat, name, ctx, ops):
        indices = ops.topk_indices(flat, self.k(ctx.numel))
        return [ops.gather(flat, indices), indices]

    def payload_nbytes(self, shape, itemsize):
        numel = numel_of(shape)
        return self.k(numel) * (itemsize + (4 if index_dtype(numel) == "int32" else 8))
