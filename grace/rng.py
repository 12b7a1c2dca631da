"""The counter-based generator behind every random draw in ``grace``: the same numbers in every
framework, on every device, in C and in numpy.

A draw is a pure function of (seed, element index), so any range of a tensor can be drawn by itself,
and a seed made of (the compressor's seed, the tensor's name, the step, the worker) gives each worker
its own stream without any generator state to save. Random-k's index draws (a choice without
replacement, which a counter cannot give cheaply) use numpy's PCG64 seeded the same way. Adapters
draw through ``Ops.random_uniform`` and ``Ops.random_indices``, which decide where the numbers are made
(the CPU, a GPU, or when a traced graph runs); the numbers are defined here.
"""

from __future__ import annotations

from typing import Any

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
    from grace import native

    if native.worth_running(n, []):
        return native.uniform(n, seed)
    return reference_uniform(n, seed)


def draw_indices(n: int, k: int, seed: int):
    """The one definition of random-k's index draw, shared by every adapter: ascending, so that
    gathering and scattering walk memory forwards (see ``Ops.topk_indices``)."""
    import numpy as np

    from grace.ops import index_dtype  # grace.ops draws through this module

    # shuffle=False: the draw's order is sorted away, and numpy shuffles only after choosing the
    # set (Floyd's algorithm) or by choosing it (a partial shuffle), so the indices are the same.
    chosen = np.random.default_rng(seed).choice(n, size=k, replace=False, shuffle=False)
    return np.sort(chosen).astype(index_dtype(n))
