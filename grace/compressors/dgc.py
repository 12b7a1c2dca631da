from __future__ import annotations

from grace.compressor import Seeded, compute_dtype
from grace.compressors.topk import TopK, kept
from grace.kernels import accelerated
from grace.ops import index_dtype
from grace.validation import check_int, check_ratio

WARMUP_RATIOS = (0.25, 0.0625, 0.015625, 0.004, 0.001)
"""DGC's sparsity warm-up: 75%, 93.75%, 98.4375%, 99.6%, then 99.9% (or ``ratio``) of each
gradient stays local, one stage per ``sparsity_warmup_steps`` steps."""


class DGC(Seeded, TopK):
    """Deep Gradient Compression: top-k with a threshold estimated on a random sample. The magnitude
    that keeps ``ratio`` of a ``sample_ratio`` sample (lowered by 20%) selects candidates, and exactly
    the k largest of them are sent (or of the whole tensor, should too few pass), as values and int32
    indices; k is at least 16 (``kept``). That is the exact top-k either way, so where the C loops
    runs its top-k kernel finds it directly (``sampled_top_k``), and ``sample_ratio`` and ``seed``
    change nothing sent. Its ``dgc`` memory adds momentum correction, local gradient
    clipping and momentum factor masking, with the wrapped optimizer's momentum taken over so that it
    applies once;
    ``sparsity_warmup_steps`` > 0 raises sparsity in stages (``WARMUP_RATIOS``) over the first
    steps. Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training", ICLR 2018."""

    name = "dgc"
    # Measured by the quality benchmark (docs/quality.md, data/quality/safety.md).
    shortfalls = {
        "lstm-sgd": "+4.7% (PyTorch) and +10% (TensorFlow) perplexity at 4,000 steps, +2.8% and "
                    "+6.0% at three times the steps: over an optimizer without momentum it applies "
                    "none, and 0.1% a step without momentum learns this model more slowly (not the "
                    "clipping: without it, the same); dgc(momentum=0.9) ended 2.3% (PyTorch) and "
                    "5.8% (TensorFlow) below uncompressed training there, but 29% above it on the "
                    "word model, whose plain SGD cannot take ten times larger steps",
    }
    default_memory = "dgc"
    default_communicator = "allgather"

    def __init__(self, ratio: float = 0.001, sample_ratio: float = 0.01,
                 sparsity_warmup_steps: int = 0, seed: int = 0):
        super().__init__(ratio)
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio)
        self.sparsity_warmup_steps = check_int("sparsity_warmup_steps", sparsity_warmup_steps,
                                               minimum=0)
        self._init_seed(seed)

    def params(self):
        return {"ratio": self.ratio, "sample_ratio": self.sample_ratio,
                "sparsity_warmup_steps": self.sparsity_warmup_steps, "seed": self.seed}

    def ratio_at(self, step: int) -> float:
        """The fraction sent at ``step`` (0-based), following the warm-up schedule."""
        if self.sparsity_warmup_steps == 0:
            return self.ratio
        stage = step // self.sparsity_warmup_steps
        return max(self.ratio, WARMUP_RATIOS[stage]) if stage < len(WARMUP_RATIOS) else self.ratio

    def compress_flat(self, flat, name, ctx, ops):
        n = ctx.numel
        step = self.next_step(name, ops)
        if self.sparsity_warmup_steps:
            if not isinstance(step, int):
                raise ValueError("DGC's sparsity warm-up changes the payload size from stage to "
                                 "stage; inside tf.function use sparsity_warmup_steps=0, or run eagerly")
            ratio = self.ratio_at(step)
        else:
            ratio = self.ratio
        k = kept(ratio, n)
        x = ops.cast(flat, compute_dtype(ctx.dtype))
        m = min(n, max(int(n * self.sample_ratio), 1))
        indices = sampled_top_k(ops, x, seed=(self._seed_of(name, ctx, shared=False), step), k=k, m=m)
        indices = ops.cast(indices, index_dtype(n))
        return [ops.gather(flat, indices), indices]

    def owner_codec(self):
        """Through the shards' owners an owner selects as DGC does, its own ``k`` of its shard:
        measured within 0.06 point of gathering on mnist at 4 workers (3 simulated seeds; +0.13
        over the last 3 passes), so it keeps no more (docs/results.md)."""
        return self

    def k(self, numel: int) -> int:
        """The most entries sent at any step (warm-up included), for the dense fallback."""
        return kept(max(self.ratio_at(0), self.ratio), numel)


@accelerated("sampled_top_k")
def sampled_top_k(ops, x, *, seed, k: int, m: int):
    """DGC's selection: the magnitude that keeps ``k`` of ``n`` in a random sample of ``m``
    elements (``seed``: ``(seed_of, step)``), lowered by 20%, picks candidates, and the k largest
    of them are the k largest of the tensor (every element left out is smaller than every
    candidate); should fewer than k pass, the whole tensor is ranked. The result is the exact top-k
    either way, so the loop that runs instead is the C top-k, with a sample of its own."""
    n = ops.numel(x)
    picked = ops.random_indices(n, m, seed[0], seed[1], like=x)
    rank = m - max(1, int(m * k / n))
    threshold = ops.scale(ops.order_statistics(ops.abs(ops.gather(x, picked)), [rank]), 0.8)
    candidates = ops.indices_at_least(x, threshold)
    return ops.cond(
        ops.size(candidates) >= k,
        lambda: ops.gather(candidates, ops.topk_indices(ops.gather(x, candidates), k)),
        lambda: ops.topk_indices(x, k))
