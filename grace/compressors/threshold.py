from __future__ import annotations

from grace.compressor import LENGTH_BYTES, Compressor, Sparse, at_least_bytes
from grace.ops import INDEX_BYTES, index_dtype
from grace.validation import check_positive


class Threshold(Sparse, Compressor):
    """Threshold sparsification: send every entry whose magnitude reaches ``threshold``, as (values,
    int32 indices); error feedback keeps the rest. How many entries that is varies from step to step
    and worker to worker, so the payload lengths travel with it. Should so many pass on some worker
    that its payload would not be smaller than the tensor, every worker sends the tensor dense that
    step (``agrees_on_form``). Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing", Interspeech 2015."""

    name = "threshold"
    default_memory = "residual"
    default_communicator = "allgather"
    fixed_size = False
    agrees_on_form = True

    def __init__(self, threshold: float = 0.01):
        self.threshold = check_positive("threshold", threshold)

    def params(self):
        return {"threshold": self.threshold}

    def not_smaller(self, flat, ctx, ops):
        entry = ops.itemsize(ctx.dtype) + INDEX_BYTES[index_dtype(ctx.numel)]
        encoded = ops.count_at_least(flat, self.threshold) * entry + 2 * LENGTH_BYTES
        return at_least_bytes(encoded, ctx.numel * ops.itemsize(ctx.dtype), ops, like=flat)

    def compress_flat(self, flat, name, ctx, ops):
        indices = ops.indices_at_least(flat, self.threshold)
        return [ops.gather(flat, indices), indices]
