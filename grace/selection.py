"""Top-k selection by magnitude, exact, for every adapter alike: among candidates above a threshold
estimated on a strided sample where the tensor is large, else by ranking every element; one call of
grace/native's loop where it runs. ``Ops.topk_indices`` is this."""

from __future__ import annotations

from typing import Any, Sequence

from grace.dtypes import Tensor, index_dtype
from grace.kernels import accelerated

SAMPLED_TOPK_MIN = 1 << 18
"""From this many elements, ``Ops.topk_indices`` selects among the candidates above a threshold
estimated on a sample instead of ranking the whole tensor (measured: 3-6 times faster on the CPU
for 1% of 2.4 M elements)."""
SAMPLED_TOPK_MARGINS = (1.3, 3.0)
"""How many times k candidates the sampled threshold aims at: first 1.3 k, and should fewer than k
pass, 3 k; then the full ranking."""
SAMPLE_SIZE = 65536
"""About how many elements the strided sample holds."""


def sampled_topk_indices(ops: Any, x: Tensor, k: int, n: int) -> Tensor:
    """The exact top-k of the 1-d ``x`` (``n`` elements) by magnitude, ascending: a threshold
    ``t`` from a strided sample of ``|x|`` aims at ``SAMPLED_TOPK_MARGINS[0]`` k candidates with
    ``|x| >= t``, and the k largest of those are ranked. Any ``t > 0`` that keeps at least k
    candidates gives the exact answer (every element left out is smaller than every candidate);
    with too few the next margin is tried, and then ``full_topk_indices``, at once if ``t`` is 0."""
    stride = max(1, n // SAMPLE_SIZE)
    sample = ops.abs(ops.strided(x, stride))
    size = -(-n // stride)
    index_type = index_dtype(n)

    def attempt(margins: Sequence[float]) -> Tensor:
        if not margins:
            return ops.full_topk_indices(x, k)
        rank = min(size - 1, int(size * k * margins[0] / n))
        threshold = ops.order_statistics(sample, [size - rank - 1])

        def among_candidates():
            candidates = ops.indices_at_least(x, threshold)

            def ranked():
                chosen = ops.full_topk_indices(ops.gather(x, candidates), k)
                return ops.cast(ops.gather(candidates, chosen), index_type)  # candidates ascend

            return ops.cond(ops.size(candidates) >= k, ranked, lambda: attempt(margins[1:]))

        # A threshold of 0 stays 0 at a larger margin (a lower rank): rank everything at once.
        return ops.cond(threshold > 0, among_candidates, lambda: ops.full_topk_indices(x, k))

    return attempt(SAMPLED_TOPK_MARGINS)


@accelerated("exact_top_k")
def exact_top_k(ops: Any, x: Tensor, *, k: int) -> Tensor:
    """``Ops.topk_indices``: from ``SAMPLED_TOPK_MIN`` elements (k at most an eighth of them) the
    exact top-k among the candidates above a threshold estimated on a strided sample
    (``sampled_topk_indices``), else by ranking every element (``Ops.full_topk_indices``). The
    kernel does the same in one call, with a sample of its own."""
    n = ops.static_numel(x)
    if n is None or n < SAMPLED_TOPK_MIN or k * 8 > n:
        return ops.full_topk_indices(x, k)
    return sampled_topk_indices(ops, x, k, n)
