from __future__ import annotations

from grace.compressor import Compressor, numel_of
from grace.ops import index_dtype
from grace.validation import check_ratio


class TopK(Compressor):
    """Top-k sparsification: each worker sends the ``k = max(1, int(ratio * numel))`` entries of
    largest magnitude as (values, int32 indices) and drops the rest, which error feedback (the
    ``residual`` memory) adds back into later steps. Workers pick different indices, so payloads are
    gathered, not summed, and the receivers add them up. Aji & Heafield, "Sparse Communication for
    Distributed Gradient Descent", EMNLP 2017; Stich et al., "Sparsified SGD with Memory", NeurIPS
    2018."""

    name = "topk"
    default_memory = "residual"
    default_communicator = "allgather"

    def __init__(self, ratio: float = 0.01):
        self.ratio = check_ratio("ratio", ratio)

    def params(self):
        return {"ratio": self.ratio}

    def k(self, numel: int) -> int:
        return max(1, int(self.ratio * numel))

    def encode(self, flat, name, ctx, ops):
        indices = ops.topk_indices(flat, self.k(ctx.numel))
        return [ops.gather(flat, indices), indices]

    def decode(self, payload, ctx, ops):
        values, indices = payload
        return ops.scatter_add(ctx.numel, indices, values)

    def payload_nbytes(self, shape, itemsize):
        numel = numel_of(shape)
        return self.k(numel) * (itemsize + (4 if index_dtype(numel) == "int32" else 8))
