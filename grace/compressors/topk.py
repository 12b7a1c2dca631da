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


OWNERS_KEEP = 2
"""Through the shards' owners (``communicator="alltoall"``), how many times ``ratio`` of its shard
an owner keeps unless ``owner_ratio`` is set. Gathering applies the union of the workers' ``k``
entries (up to ``n k``); on mnist at 4 workers owners keeping ``k`` of the sum ended 0.96 point
below it (8 simulated seeds; 0.39 in 4 real runs), owners keeping ``2 k`` 0.20 (0.12), above ``k``
in 7 of 8 simulated seeds. It doubles the second stage: a worker moves ``3 (n-1)/n`` of one payload
where ``k`` moved ``2 (n-1)/n``, still flat in n (docs/results.md, "Eight seeds at 4 workers, and
four real ones")."""


def kept(ratio: float, numel: int, floor: int | None = None) -> int:
    """How many entries a sparsifier keeps at ``ratio``: ``ratio * numel``, at least ``floor``
    (random-k's ``min_kept``; by default ``MIN_KEPT``, read when called), at most ``numel``."""
    return min(numel, max(MIN_KEPT if floor is None else floor, int(ratio * numel)))


class TopK(Sparse, Compressor):
    """Top-k sparsification: each worker sends the ``k = max(16, int(ratio * numel))`` entries of
    largest magnitude (``kept``) as (values, int32 indices) and drops the rest, which error
    feedback adds back into later steps. The error feedback is on the velocity, as DGC's momentum
    correction and 1-bit SGD's: the wrapped optimizer's momentum is taken over (the ``momentum``
    memory) and what is sparsified is the residual plus the velocity, since the optimizer's
    momentum acting after the exchange on entries the residual sends late cost up to 2.4 points on
    mnist (docs/quality.md, "Top-k's momentum"); with an optimizer without momentum this is plain
    error feedback, and ``memory="residual"`` or ``keep_optimizer=True`` leaves the momentum to the
    optimizer. Workers pick different indices, so payloads are gathered, not summed, and the
    receivers add them up; through the shards' owners an owner keeps the top ``owner_ratio`` of its
    shard's sum (``OWNERS_KEEP * ratio`` by default). Aji & Heafield, "Sparse Communication for
    Distributed Gradient Descent", EMNLP 2017; Stich et al., "Sparsified SGD with Memory", NeurIPS
    2018; Lin et al., "Deep Gradient Compression", ICLR 2018 (momentum correction)."""

    name = "topk"
    default_memory = "momentum"  # error feedback on the velocity, the optimizer's momentum taken over
    default_communicator = "allgather"
    owner_ratio: float | None = None

    def __init__(self, ratio: float = 0.01, owner_ratio: float | None = None):
        self.ratio = check_ratio("ratio", ratio)
        self.owner_ratio = None if owner_ratio is None else check_ratio("owner_ratio", owner_ratio)

    def params(self):
        # owner_ratio only where set: a default top-k reads (and checkpoints) as it always has.
        return {"ratio": self.ratio} | ({} if self.owner_ratio is None else {"owner_ratio": self.owner_ratio})

    def owner_codec(self):
        """Through the shards' owners an owner keeps the top ``owner_ratio`` of its shard's sum,
        by default ``OWNERS_KEEP * ratio`` (at most all of it)."""
        return TopK(self.owner_ratio if self.owner_ratio is not None
                    else min(1.0, OWNERS_KEEP * self.ratio))

    def k(self, numel: int) -> int:
        return kept(self.ratio, numel)

    def compress_flat(self, flat, name, ctx, ops):
        indices = ops.topk_indices(flat, self.k(ctx.numel))
        return [ops.gather(flat, indices), indices]

    def payload_nbytes(self, shape, itemsize):
        numel = numel_of(shape)
        return self.k(numel) * (itemsize + (4 if index_dtype(numel) == "int32" else 8))
