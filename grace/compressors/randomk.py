from __future__ import annotations

from grace.compressor import DEFAULT_MIN_NUMEL, Compressor, Seeded, Sparse, numel_of
from grace.compressors.topk import kept
from grace.validation import check_bool, check_int, check_ratio


class RandomK(Seeded, Sparse, Compressor):
    """Random-k sparsification: each step keeps ``k = max(min_kept, int(ratio * numel))`` entries
    (all of a tensor no larger than ``min_kept``) chosen uniformly at random and sends only their
    values. The indices are never sent: every worker draws
    the same ones from a private generator seeded by (``seed``, tensor name, step), so payloads share
    one layout and allreduce can sum them. With ``scale=True`` the values are multiplied by
    ``numel / k``, which makes the estimate unbiased; by default the dropped part is kept by error
    feedback instead (the ``delayed`` memory, which turns the optimizer's momentum off: momentum on
    updates delayed ~1/ratio steps diverges). An element waits about ``numel / k`` steps between
    sends; the floor of ``min_kept`` (1,024 values, the pipeline's default ``min_numel``, so that no
    compressed tensor sends fewer values than a dense one just below it) bounds that wait on small
    tensors such as an output layer, where it costs most accuracy (docs/quality.md, "With Adam").
    Stich et al., "Sparsified SGD with Memory", NeurIPS 2018."""

    name = "randomk"
    summable = True
    default_memory = "delayed"
    default_communicator = "allreduce"
    encodes_rows = False
    adam_caution = (
        "its error feedback sends each element about every 1/ratio steps, and Adam divides those "
        "bursts by their own size: measured on mnist it ends 1-2 points below uncompressed Adam "
        "(at 10% of the elements still 1.5); with Adam prefer topk or dgc (docs/quality.md, "
        "'With Adam')")

    def __init__(self, ratio: float = 0.01, seed: int = 0, scale: bool = False,
                 min_kept: int = DEFAULT_MIN_NUMEL):
        self.ratio = check_ratio("ratio", ratio)
        self._init_seed(seed)
        self.scale = check_bool("scale", scale)
        self.min_kept = check_int("min_kept", min_kept, minimum=1)

    def params(self):
        return {"ratio": self.ratio, "seed": self.seed, "scale": self.scale,
                "min_kept": self.min_kept}

    def k(self, numel: int) -> int:
        return kept(self.ratio, numel, self.min_kept)

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
