"""The counter-based generator behind every random draw in ``grace``: the same numbers in every
framework, on every device, in C and in numpy.

A draw is a pure function of (seed, element index), so any range of a tensor can be drawn by itself,
and a seed made of (the compressor's seed, the tensor's name, the step, the worker) gives each worker
its own stream without any generator state to save. Random-k's index draws (a choice without
replacement) take the counter's picks in order until enough distinct ones are seen. Adapters
draw through ``Ops.random_uniform`` and ``Ops.random_indices``, which decide where the numbers are made
(the CPU, a GPU, or when a traced graph runs); the numbers are defined here.
"""

from __future__ import annotations

from typing import Any

from grace import native
from grace.dtypes import index_dtype

UNIFORM_SCALE = 2.0**-24
"""``counter_uniform_bits`` gives 24 bits; times this, a float32 in [0, 1), exactly."""


def _lowbias32(x: Any, mask: int) -> Any:
    """Chris Wellons's "lowbias32" integer hash, on values below 2**32 held in any integer type
    (numpy uint32, or int64 where unsigned 32-bit products are not to be had): every product is
    reduced to its low 32 bits, which wrap-around in the wider type keeps exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def counter_uniform_bits(index: Any, seed: int) -> Any:
    """24 random bits for each element index, a pure function of (seed, index): a counter-based
    generator (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011) built from two
    rounds of an integer hash keyed by the seed's two 32-bit words. Any range of a tensor can be drawn
    by itself, on any device, and every adapter (numpy, torch on CPU or GPU, grace/native's C) gets
    the same bits. ``index``: a numpy uint32 array or a torch int64 tensor (indices below 2**32)."""
    mask = 0xFFFFFFFF
    k0, k1 = seed & mask, (seed >> 32) & mask
    h = _lowbias32((index + k0) & mask, mask)
    return _lowbias32(h ^ k1, mask) >> 8


def reference_uniform(n: int, seed: int):
    """``counter_uniform_bits`` as float32 in [0, 1), in numpy."""
    import numpy as np

    bits = counter_uniform_bits(np.arange(n, dtype=np.uint32), seed)
    return bits.astype(np.float32) * np.float32(UNIFORM_SCALE)


def draw_uniform(n: int, seed: int):
    """``n`` float32 draws from [0, 1) for ``seed`` as a numpy array: grace/native's loop where it
    is built, else numpy; the same numbers either way."""
    if native.worth_running(n, []):
        return native.uniform(n, seed)
    return reference_uniform(n, seed)


INDEX_LIMIT = 2**31
"""Random-k draws from tensors below this many elements (its counter's indices are 32 bits)."""


def bounded_picks(draws: Any, n: int, seed: int):
    """Element ``(hi * n + (lo * n >> 24)) >> 24`` of ``[0, n)`` for each draw number ``j``
    (numpy uint32): ``hi`` and ``lo`` are ``counter_uniform_bits`` at ``2j`` and ``2j + 1``, a
    48-bit uniform, so this is ``floor(u * n)`` exactly in 64-bit integers (each element's chance
    is 1/n within n / 2**48)."""
    import numpy as np

    hi = counter_uniform_bits(2 * draws, seed).astype(np.uint64)
    lo = counter_uniform_bits(2 * draws + 1, seed).astype(np.uint64)
    return (hi * np.uint64(n) + ((lo * np.uint64(n)) >> np.uint64(24))) >> np.uint64(24)


def reference_indices(n: int, k: int, seed: int):
    """Random-k's choice of ``k`` of ``n`` indices, in numpy: the picks of ``bounded_picks`` for
    draws 0, 1, 2, ..., whose first ``m`` distinct values are the set (every m-subset equally
    likely: drawing uniformly until m distinct values are seen is choosing without replacement).
    Where ``k > n / 2`` the ``n - k`` left out are drawn instead, so that the draws stay below
    ``n ln 2``. Ascending, in ``index_dtype(n)``. A pure function of (n, k, seed), with no generator
    to hold: grace/native's loop gives the same indices from a bitmap."""
    import numpy as np

    check_draw(n, k)
    complement = k > n - k
    m = n - k if complement else k
    picks = np.empty(0, np.uint64)
    values = first = np.empty(0, np.int64)
    batch = m + m * m // max(n, 1) + 64  # the repeats expected, and some
    while values.size < m:
        draws = np.arange(picks.size, picks.size + batch, dtype=np.uint32)
        picks = np.concatenate([picks, bounded_picks(draws, n, seed)])
        values, first = np.unique(picks, return_index=True)
        batch *= 2
    chosen = picks[np.sort(first)[:m]].astype(np.int64)
    if not complement:
        return np.sort(chosen).astype(index_dtype(n))
    keep = np.ones(n, bool)
    keep[chosen] = False
    return np.flatnonzero(keep).astype(index_dtype(n))


def check_draw(n: int, k: int) -> None:
    if not 0 <= k <= n:
        raise ValueError(f"random indices: k must be in [0, n], got k={k}, n={n}")
    if n >= INDEX_LIMIT:
        raise ValueError(f"random indices: tensors below 2**31 elements, got n={n}")


def draw_indices(n: int, k: int, seed: int):
    """The one definition of random-k's index draw, shared by every adapter: ``reference_indices``,
    run by grace/native's loop where it is built (a bitmap in place of numpy's sorts: 0.36 ms for
    1% of 2.4 M elements, against 1.05 ms for numpy's choice and sort). Ascending, so that
    gathering and scattering walk memory forwards (see ``Ops.topk_indices``)."""
    check_draw(n, k)
    if native.available():
        return native.choose_indices(n, k, seed)
    return reference_indices(n, k, seed)
