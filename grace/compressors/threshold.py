from __future__ import annotations

from grace.compressor import Compressor
from grace.ops import index_dtype
from grace.validation import check_positive


class Threshold(Compressor):
    """Threshold sparsification: send every entry whose magnitude reaches ``threshold``, as (values,
    int32 indices); error feedback keeps the rest. How many entries that is varies from step to step
    and worker to worker, so the payload lengths travel with it. When so many entries pass that the
    sparse form would not be smaller, the dense tensor is sent instead (its indices left empty).
    Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing", Interspeech
    2015."""

    name = "threshold"
    default_memory = "residual"
    default_communicator = "allgather"
    fixed_size = False

    def __init__(self, threshold: float = 0.01):
        self.threshold = check_positive("threshold", threshold)

    def params(self):
        return {"threshold": self.threshold}

    def encode(self, flat, name, ctx, ops):
        n = ctx.numel
        itemsize, index_size = ops.itemsize(ctx.dtype), ops.itemsize(index_dtype(n))
        # Counted first, so that a tensor that goes dense never has its indices listed.
        sparse_is_larger = ops.count_at_least(flat, self.threshold) * (itemsize + index_size) >= n * itemsize

        def sparse():
            indices = ops.indices_at_least(flat, self.threshold)
            return [ops.gather(flat, indices), indices]

        return ops.cond(sparse_is_larger,
                        lambda: [flat, ops.zeros(0, index_dtype(n), like=flat)], sparse)

    def decode(self, payload, ctx, ops):
        values, indices = payload
        return ops.cond(ops.size(values) == ctx.numel, lambda: values,
                        lambda: ops.scatter_add(ctx.numel, indices, values))
