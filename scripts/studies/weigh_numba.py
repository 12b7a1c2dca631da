"""Weigh numba against grace/native's C on two of its loops: the same bits, steady speed, first-call
cost (docs/performance.md, "Why a page of C").

numba is not a dependency of grace; to run this, put it beside the environment:

    .venv/bin/pip install --no-deps --target /tmp/numba numba==0.68.1 llvmlite==0.50.0
    PYTHONPATH=/tmp/numba .venv/bin/python -m scripts.studies.weigh_numba

The loops are QSGD's stochastic rounding to levels (with the counter-based draws) and the sign bits
of the sign family, written in numba as the C writes them; both run on one thread.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("GRACE_NATIVE_THREADS", "1")  # one thread each: the loops, not the pool

import numpy as np

from grace import native

MASK = 0xFFFFFFFF


def build():
    """The numba loops, compiled at their first call (as a user's process would)."""
    import numba

    u64 = np.uint64

    @numba.njit(inline="always")
    def lowbias32(x):
        # numba widens uint32 arithmetic to 64 bits: each product is taken back to its low 32.
        m = u64(MASK)
        x = u64(x) & m
        x ^= x >> u64(16)
        x = (x * u64(0x7FEB352D)) & m
        x ^= x >> u64(15)
        x = (x * u64(0x846CA68B)) & m
        return x ^ (x >> u64(16))

    @numba.njit
    def quantize_levels(x, divisors, block, levels, k0, k1, bits, out):
        per = 8 // bits
        top = np.float32(levels)
        for b in range((x.size + per - 1) // per):
            byte = np.uint8(0)
            for j in range(min(per, x.size - b * per)):
                i = b * per + j
                v = x[i]
                h = lowbias32(lowbias32(u64(i) + u64(k0)) ^ u64(k1))
                u = np.float32(h >> u64(8)) * np.float32(2.0**-24)
                level = (np.float32(abs(v)) / divisors[i // block]) * top
                low = np.float32(np.floor(level))
                q = low + (np.float32(1.0) if u < level - low else np.float32(0.0))
                q = max(min(q, top), np.float32(0.0))
                byte |= np.uint8(((np.int32(q) * 2 + (1 if v < 0 else 0)) & ((1 << bits) - 1)) << (bits * j))
            out[b] = byte

    @numba.njit
    def sign_bits(x, out):
        for b in range((x.size + 7) // 8):
            byte = np.uint8(0)
            for j in range(min(8, x.size - b * 8)):
                if x[b * 8 + j] >= 0:
                    byte |= np.uint8(1 << j)
            out[b] = byte

    return quantize_levels, sign_bits


def fastest(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit(f"grace/native is not available: {native.reason()}")
    start = time.perf_counter()
    quantize_levels, sign_bits = build()
    import_ms = (time.perf_counter() - start) * 1e3

    n, block, levels, bits, seed = args.numel, 512, 7, 4, 0x1234_5678_9ABC_DEF0
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    divisors = np.sqrt(np.add.reduceat(x.astype(np.float64) ** 2, np.arange(0, n, block))).astype(np.float32)
    k0, k1 = seed & MASK, seed >> 32
    codes = np.empty((n * bits + 7) // 8, np.uint8)
    signs = np.empty((n + 7) // 8, np.uint8)

    def numba_quantize():
        quantize_levels(x, divisors, block, levels, k0, k1, bits, codes)

    def c_quantize():
        return native.quantize_levels(x, divisors, seed, levels, bits, block)

    first = {}
    for label, fn in (("quantize, numba", numba_quantize), ("signs, numba", lambda: sign_bits(x, signs)),
                      ("quantize, C", c_quantize)):
        start = time.perf_counter()
        fn()
        first[label] = (time.perf_counter() - start) * 1e3
    same = np.array_equal(codes, c_quantize()) and np.array_equal(signs, native.sign_bits(x))
    rows = [("quantize_levels (4 bits, buckets of 512)", numba_quantize, c_quantize),
            ("sign_bits", lambda: sign_bits(x, signs), lambda: native.sign_bits(x))]
    print(f"{n:,} float32 elements, one thread; numba {__import__('numba').__version__}")
    print(f"import numba: {import_ms:.0f} ms; first calls (numba compiles): "
          + ", ".join(f"{k} {v:.0f} ms" for k, v in first.items()))
    print(f"the same bits as the C: {same}")
    print("| loop | numba ms | C ms | numba / C |\n|---|---:|---:|---:|")
    for label, with_numba, with_c in rows:
        a, b = fastest(with_numba, args.repeats), fastest(with_c, args.repeats)
        print(f"| {label} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f} |")
    copy = fastest(lambda: x.copy(), args.repeats)
    print(f"(a copy of the tensor: {copy * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
