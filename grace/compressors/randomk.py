from __future__ import annotations

from grace.compressor import DEFAULT_MIN_NUMEL, Compressor, Seeded, Sparse, numel_of
from grace.compressors.topk import kept
from grace.second_moment import SharedSecondMoment
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
    Wrapping Adam, it takes Adam's moments over (``moments``, ``grace.second_moment``): the payload
    carries each worker's second moment at the drawn entries too, and the combined bursts come out
    divided by the shared second moment's root, for the wrapper to step by the learning rate
    (``take_adam_moments=False`` leaves Adam as it is: for a script that clips or rescales the
    gradients between ``synchronize()`` and ``step()``, which would then act on updates).
    Stich et al., "Sparsified SGD with Memory", NeurIPS 2018."""

    name = "randomk"
    summable = True
    default_memory = "delayed"
    default_communicator = "allreduce"
    encodes_rows = False
    # Measured by the quality benchmark (docs/quality.md, data/quality/safety.md).
    shortfalls = {
        "lstm-sgd": "+2.0% (PyTorch) and +8.6% (TensorFlow) perplexity at 4,000 steps "
                    "(PyTorch's the mean of two seeds, the target's edge; +1.8% on a third), "
                    "+1.5% and +5.0% at three "
                    "times the steps: each element is sent about every 1/ratio steps, so it learns "
                    "more slowly (ratio=0.1: +3.1% and +7.2%); topk ends within 1.5% there",
        "words-sgd": "+107% perplexity (the mean of two seeds, +90% and +124%), rising after "
                     "its second epoch: its "
                     "error feedback sends each element about every 1/ratio steps with all it "
                     "held, bursts this model's plain SGD at lr 0.5 does not take (with "
                     "memory='none' it falls, slowly: +63%); randomk(ratio=0.1) ends 0.6% below "
                     "uncompressed training there",
    }
    adam_caution = (
        "its error feedback sends each element about every 1/ratio steps, and Adam divides those "
        "bursts by their own size: measured on mnist it ends 1-2 points below uncompressed Adam. "
        "grace takes Adam's moments over to avoid that where it can (hvd.DistributedOptimizer over "
        "torch or Keras Adam/AdamW without AMSGrad, in Keras also without clipping, a loss scale, "
        "EMA or accumulation; random-k's own error feedback over allreduce, hvd.Average, no "
        "warm-up), not here: prefer topk or dgc "
        "(docs/quality.md, 'With Adam')")
    moments: SharedSecondMoment | None = None
    """Adam's second moment, when the wrapper took it over (``Pipeline.take_adam_moments``)."""

    def __init__(self, ratio: float = 0.01, seed: int = 0, scale: bool = False,
                 min_kept: int = DEFAULT_MIN_NUMEL, take_adam_moments: bool = True):
        self.ratio = check_ratio("ratio", ratio)
        self._init_seed(seed)
        self.scale = check_bool("scale", scale)
        self.min_kept = check_int("min_kept", min_kept, minimum=1)
        self.take_adam_moments = check_bool("take_adam_moments", take_adam_moments)

    @property
    def can_take_second_moment(self) -> bool:
        """Whether its payload can carry Adam's second moment: values as they are (not scaled),
        unless ``take_adam_moments=False`` leaves Adam as it is."""
        return self.take_adam_moments and not self.scale

    def params(self):
        return {"ratio": self.ratio, "seed": self.seed, "scale": self.scale,
                "min_kept": self.min_kept, "take_adam_moments": self.take_adam_moments}

    def notice(self) -> str | None:
        if self.min_kept <= 1:
            return None
        return (f"grace: randomk keeps at least min_kept={self.min_kept} entries of every tensor it "
                f"compresses (all of a smaller one), so tensors under min_kept/ratio = "
                f"{self.min_kept / self.ratio:,.0f} elements send more than ratio={self.ratio} of "
                f"theirs: the wait between an element's sends costs small tensors most "
                f"(docs/quality.md, 'With Adam'); min_kept=1 keeps the ratio on every tensor")

    def k(self, numel: int) -> int:
        return kept(self.ratio, numel, self.min_kept)

    def step_seed(self, name: str, step: int) -> int:
        """The generator's seed for ``name`` at ``step``: a stable hash (Python's ``hash`` differs
        between processes)."""
        return self._seed_of(name, None, shared=True)(step)

    def compress_flat(self, flat, name, ctx, ops):
        k = self.k(ctx.numel)
        indices = self.indices(ctx.numel, k, name, ctx, ops, like=flat, shared=True)
        ctx.data["indices"] = indices
        values = ops.gather(flat, indices)
        if self.scale:
            values = ops.scale(values, ctx.numel / k)
        if self.moments is None:
            return [values]
        ctx.data["name"] = name
        return [values, self.moments.drawn(name, indices, ops, like=flat)]

    def aggregate_payloads(self, payloads, ctx, ops, scale=1.0):
        burst = super().aggregate_payloads(payloads, ctx, ops, scale)
        if self.moments is None:
            return burst
        mean = self.aggregate([p[1] for p in payloads], ops)
        if scale != 1.0:
            mean = ops.scale(mean, scale)
        update = self.moments.precondition(ops.flatten(burst), mean, ctx.data["indices"],
                                           ctx.data["name"], ops)
        return ops.reshape(update, ctx.shape)

    def positions(self, payload, ctx):
        return ctx.data["indices"]  # drawn alike on every worker, never sent

    def sent_indices(self, payload, ctx):
        return None if self.scale else ctx.data["indices"]  # scaled values are not the tensor's

    def payload_nbytes(self, shape, itemsize):
        return self.k(numel_of(shape)) * itemsize * (1 if self.moments is None else 2)
