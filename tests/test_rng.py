"""grace.rng and ``stable_seed``, the draws behind every stochastic compressor (QSGD, TernGrad,
natural, random-k, SketchML and AdaQ's samples), checked against their definitions written here
in plain Python integers, and for the properties the compressors rely on. The numpy models of
tests/reference.py take their draws from ``grace.rng``; these tests are what keeps those draws
honest: a changed hash constant, seed text or pick rule fails here, not only in a model."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from grace.compressor import stable_seed
from grace.rng import UNIFORM_SCALE, draw_indices, draw_uniform, reference_indices, reference_uniform

MASK = 0xFFFFFFFF


def lowbias32(x: int) -> int:
    """Chris Wellons's lowbias32 hash of a 32-bit integer, as published (hash-prospector)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


def bits24(index: int, seed: int) -> int:
    """The counter generator's 24 bits for ``index``: two hash rounds keyed by the seed's low and
    high 32-bit words, the top 24 bits kept."""
    return lowbias32(lowbias32((index + (seed & MASK)) & MASK) ^ (seed >> 32)) >> 8


def chosen(n: int, k: int, seed: int) -> list[int]:
    """Random-k's choice by its definition: draw j picks ``floor(u * n)`` of the 48-bit uniform
    made of the 24 bits at counters 2j and 2j + 1; the first ``m`` distinct picks are the set,
    ``m = min(k, n - k)``, and where ``k > n / 2`` the set is what is left out."""
    m = min(k, n - k)
    seen: list[int] = []
    j = 0
    while len(seen) < m:
        hi, lo = bits24(2 * j, seed), bits24(2 * j + 1, seed)
        pick = (hi * n + ((lo * n) >> 24)) >> 24
        if pick not in seen:
            seen.append(pick)
        j += 1
    return sorted(seen) if k <= n - k else sorted(set(range(n)) - set(seen))


def test_a_seed_is_the_blake2b_digest_of_its_parts_text():
    """(seed, name, step, rank) joined by "/", its 8-byte BLAKE2b digest read little-endian: the
    same in every process (Python's ``hash`` is not), and different when any part differs."""
    expected = int.from_bytes(hashlib.blake2b(b"0/layer.weight/3/1", digest_size=8).digest(), "little")
    assert stable_seed(0, "layer.weight", 3, 1) == expected
    variants = {stable_seed(0, "layer.weight", 3, 1), stable_seed(1, "layer.weight", 3, 1),
                stable_seed(0, "layer.bias", 3, 1), stable_seed(0, "layer.weight", 4, 1),
                stable_seed(0, "layer.weight", 3, 0), stable_seed(0, "layer.weight", 3)}
    assert len(variants) == 6


@pytest.mark.parametrize("seed", [0, 12345, stable_seed(0, "w/1", 7, 2), 2**64 - 1])
def test_uniform_draws_are_the_counter_hash_of_their_index(seed):
    """Every draw is ``bits24(index, seed) * 2**-24``, at any index (the first ones and some past
    2**20), in numpy and in grace/native's loop alike."""
    n = (1 << 20) + 9
    numpy_draws, drawn = reference_uniform(n, seed), draw_uniform(n, seed)
    np.testing.assert_array_equal(numpy_draws, drawn)
    for i in [0, 1, 2, 3, 1000, 1 << 20, n - 1]:
        assert numpy_draws[i] == np.float32(bits24(i, seed) * UNIFORM_SCALE)


def test_uniform_draws_are_uniform_and_independent_between_seeds():
    """200,000 draws of a fixed seed: mean within 4 standard errors of 1/2 (a standard error is
    sqrt(1/12/n) = 0.00065), Kolmogorov-Smirnov distance below 1.63/sqrt(n), its 1% critical
    value; two seeds' streams uncorrelated within 4/sqrt(n)."""
    n = 200_000
    u = reference_uniform(n, stable_seed(0, "w", 0, 0)).astype(np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    ordered = np.sort(u)
    ks = np.max(np.maximum(np.arange(1, n + 1) / n - ordered, ordered - np.arange(n) / n))
    assert ks < 1.63 / math.sqrt(n)
    v = reference_uniform(n, stable_seed(0, "w", 0, 1)).astype(np.float64)
    assert abs(np.corrcoef(u, v)[0, 1]) < 4 / math.sqrt(n)


@pytest.mark.parametrize("n, k", [(20, 5), (20, 15), (1000, 10), (1000, 999), (7, 7), (7, 0)])
def test_random_k_chooses_by_its_definition(n, k):
    """The indices are the first distinct picks of the 48-bit draws (the left-out ones where more
    than half are kept), ascending, in numpy and in grace/native's bitmap alike."""
    seed = stable_seed(3, "w", 5)
    want = chosen(n, k, seed)
    np.testing.assert_array_equal(reference_indices(n, k, seed), want)
    np.testing.assert_array_equal(draw_indices(n, k, seed), want)


def test_random_k_gives_every_index_the_same_chance():
    """5 of 20 over 4,000 seeds: each index chosen 1,000 times in expectation; the chi-square of
    the 20 counts (19 degrees of freedom) below 43.8, its 0.1% critical value."""
    counts = np.zeros(20)
    for s in range(4000):
        counts[reference_indices(20, 5, stable_seed(0, "w", s))] += 1
    expected = 4000 * 5 / 20
    assert ((counts - expected) ** 2 / expected).sum() < 43.8
