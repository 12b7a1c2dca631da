from __future__ import annotations

from grace.compressor import LENGTH_BYTES, Compressor, capped, numel_of, payload_budget
from grace.ops import INDEX_BYTES, index_dtype
from grace.validation import check_positive


class Threshold(Compressor):
    """Threshold sparsification: send every entry whose magnitude reaches ``threshold``, as (values,
    int32 indices); error feedback keeps the rest. How many entries that is varies from step to step
    and worker to worker, so the payload lengths travel with it. Should so many pass that the
    payload would not be smaller than the tensor, only the largest that fit are sent (``capped``),
    and error feedback keeps the others for the next steps. Strom, "Scalable Distributed DNN
    Training Using Commodity GPU Cloud Computing", Interspeech 2015."""

    name = "threshold"
    default_memory = "residual"
    default_communicator = "allgather"
    fixed_size = False

    def __init__(self, threshold: float = 0.01):
        self.threshold = check_positive("threshold", threshold)

    def params(self):
        return {"threshold": self.threshold}

    @staticmethod
    def cap(numel: int, itemsize: int) -> int:
        """The most entries a payload holds and stays smaller than the tensor (lengths included)."""
        return payload_budget(numel, itemsize, 2) // (itemsize + INDEX_BYTES[index_dtype(numel)])

    def payload_nbytes(self, shape, itemsize):
        n = numel_of(shape)
        cap = self.cap(n, itemsize)
        if cap < 1:  # not even one entry fits: the tensor travels dense
            return n * itemsize
        return cap * (itemsize + INDEX_BYTES[index_dtype(n)]) + 2 * LENGTH_BYTES

    def encode(self, flat, name, ctx, ops):
        cap = self.cap(ctx.numel, ops.itemsize(ctx.dtype))
        indices = capped(flat, ops.indices_at_least(flat, self.threshold), cap, ops)
        return [ops.gather(flat, indices), indices]

    def decode(self, payload, ctx, ops):
        values, indices = payload
        return ops.scatter_add(ctx.numel, indices, values)
