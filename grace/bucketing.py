"""Which tensors travel together: buckets formed by a size bound, the same on every worker."""

from __future__ import annotations

from typing import Hashable, Sequence

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""25 MiB of dense gradient per bucket, PyTorch DDP's default: ResNet-50's 97.5 MiB of gradients
make 4 buckets, few enough that per-collective latency stays small, and the first of them is ready
early enough in the backward pass to overlap with it (docs/performance.md has the measurements)."""


def bucket_tag(names: Sequence[str]) -> str:
    """The name a bucket's collectives carry, from its tensors' names (alike on every worker)."""
    return f"grace.{names[0]}" if len(names) == 1 else f"grace.bucket.{names[0]}"


def form_buckets(nbytes: Sequence[int], bound: int, kinds: Sequence[Hashable] | None = None
                 ) -> list[list[int]]:
    """Positions ``0 .. len(nbytes) - 1`` in order, cut into buckets of consecutive tensors of one
    kind (``kinds``: e.g. how each travels, so that a bucket's payloads need one collective) of at
    most ``bound`` bytes each (a tensor larger than ``bound`` forms a bucket of its own;
    ``bound=0``: every tensor its own bucket). Buckets are listed in the order they fill."""
    kinds = kinds if kinds is not None else [None] * len(nbytes)
    buckets: list[list[int]] = []
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    for position, (size, kind) in enumerate(zip(nbytes, kinds)):
        current, filled = open_buckets.get(kind, ([], 0))
        if current and filled + size > bound:
            buckets.append(current)
            current, filled = [], 0
        open_buckets[kind] = (current + [position], filled + size)
    # The buckets still open, in the order of their first tensor.
    buckets += sorted((b for b, _ in open_buckets.values() if b), key=lambda b: b[0])
    return buckets
