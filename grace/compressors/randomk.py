from __future__ import annotations

from grace.compressor import Compressor, Seeded, Sparse, numel_of
from grace.validation import check_bool, check_ratio


class RandomK(Seeded, Sparse, Compressor):
    """Random-k sparsification: each step keeps ``k = max(1, int(ratio * numel))`` entries chosen
    uniformly at random and sends only their values. The indices are never sent: every worker draws
    the same ones from a private generator seeded by (``seed``, tensor name, step), so payloads share
    one layout and allreduce can sum them. With ``scale=True`` the values are multiplied by
    ``numel / k``, which makes the estimate unbiased; by default the dropped part is kept by error
    feedback instead (the ``delayed`` memory, which turns the optimizer's momentum off: momentum on
    updates delayed ~1/ratio steps diverges). Stich et al., "Sparsified SGD with Memory", NeurIPS
    2018."""

    name = "randomk"
    summable = True
    default_memory = "delayed"
    default_communicator = "allreduce"
    encodes_rows = False
    adam_caution = (
        "its error feedback sends each element about every 1/ratio steps, and Adam divides those "
        "bursts by their own size: measured on mnist it ends about 2 points below uncompressed "
        "Adam, at 10% of the elements still 1.5; with Adam prefer topk or dgc (docs/quality.md, "
        "'With Adam')")

    def __init__(self, ratio: float = 0.01, seed: int = 0, scale: bool = False):
        self.ratio = check_ratio("ratio", ratio)
        self._init_seed(seed)
        self.scale = check_bool("scale", scale)

    def params(self):
        return {"ratio": self.ratio, "seed": self.seed, "scale": self.scale}

    def k(self, numel: int) -> int:
        return max(1, int(self.ratio * numel))

    def step_seed(self, name: str, step: int) -> int:
        """The generator's seed for ``name`` at ``step``: a stable hash (Python's ``hash`` differs
        between processes)."""
        return self._seed_of(name, None, shared=True)(step)

    def encode(self, flat, name, ctx, ops):
        k = self.k(ctx.numel)
        indices = self.indices(ctx.numel, k, name, ctx, ops, like=flat, shared=True)
        ctx.data["indices"] = indices
        values = ops.gather(flat, indices)
        if self.scale:
            values = ops.scale(values, ctx.numel / k)
        return [values]

    def positions(self, payload, ctx):
        return ctx.data["indices"]  # drawn alike on every worker, never sent

    def sent_indices(self, payload, ctx):
        return None if self.scale else ctx.data["indices"]  # scaled values are not the tensor's

    def payload_nbytes(self, shape, itemsize):
        return self.k(numel_of(shape)) * itemsize
