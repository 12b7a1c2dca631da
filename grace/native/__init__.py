"""Fused CPU loops for float32 gradients, shared by every framework adapter.

The composite Ops code of an algorithm makes several passes over a gradient and a full-size temporary
for each step (|x|, the level, the random draws, the codes); on a CPU that costs many times a copy of
the tensor. ``kernels.c`` does each of the heavy steps in one pass, giving the same bits as the
composite code (``tests/test_native.py`` checks that). It is plain C with no framework headers, so
one build serves torch, TensorFlow (through ``tf.numpy_function``) and numpy alike: the adapters pass
raw pointers through ``ctypes``, which releases the GIL, and disjoint ranges of a large tensor run on
a few Python threads at once.

The library is compiled on first use with the system's C compiler (``$CC``, else ``cc``) and cached
under ``$GRACE_NATIVE_CACHE`` (default ``~/.cache/grace``), keyed by the source, the flags and the
CPU's features (it is built with ``-march=native``). Without a compiler, or with
``GRACE_NATIVE=0``, ``available()`` is false and the adapters keep their composite code: the same
results, more slowly. ``GRACE_NATIVE_THREADS`` sets the number of threads (default: the CPUs this
process may run on).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

MIN_NUMEL = 1 << 12
"""Adapters use the kernels from this many elements; below it the composite code costs as little."""

PARALLEL_NUMEL = 1 << 18
"""From this many elements a kernel's range is split between threads."""

MAX_BITS = 8
"""The kernels handle codes of up to this many bits."""

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.c")
_FLAGS = ["-O3", "-march=native", "-std=c11", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math", "-fPIC",
          "-shared"]

_lib: ctypes.CDLL | None = None
_error: str | None = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return sys.platform


def _build() -> str:
    compiler = os.environ.get("CC", "cc")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, _cpu_features()]).encode()).hexdigest()
    cache = os.environ.get("GRACE_NATIVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "grace"))
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"kernels-{key[:16]}.so")
    if not os.path.exists(path):
        # Workers started together may all build: each writes its own file and renames it into
        # place, which is atomic, so none loads a half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([compiler, *_FLAGS, _SOURCE, "-o", tmp, "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _declare(lib: ctypes.CDLL) -> None:
    i64, u32, f32, ptr = ctypes.c_int64, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p
    signatures = {
        "grace_uniform": [u32, u32, i64, i64, ptr],
        "grace_quantize_levels": [ptr, i64, i64, f32, f32, u32, u32, ctypes.c_int, ptr],
        "grace_sign_bits": [ptr, i64, i64, ptr, ptr],
        "grace_unpack_values": [ptr, ctypes.c_int, i64, i64, ptr, ptr],
        "grace_sums": [ptr, i64, i64, ptr],
        "grace_scaled_sum": [ptr, f32, ptr, f32, i64, i64, ptr],
        "grace_select_above": [ptr, i64, i64, f32, ptr, i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int64 if name == "grace_select_above" else None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; ``None`` where they cannot be had (see ``reason``)."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    if os.environ.get("GRACE_NATIVE", "1") == "0":
        _error = "disabled by GRACE_NATIVE=0"
        return None
    try:
        lib = ctypes.CDLL(_build())
        _declare(lib)
        _lib = lib
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        _error = f"could not build {_SOURCE}: {detail.strip()[:500]}"
    return _lib


def available() -> bool:
    return library() is not None


def reason() -> str | None:
    """Why the kernels are not in use, or ``None`` when they are."""
    library()
    return _error


def threads() -> int:
    value = os.environ.get("GRACE_NATIVE_THREADS")
    if value:
        return max(1, int(value))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _ranges(n: int) -> list[tuple[int, int]]:
    parts = threads() if n >= PARALLEL_NUMEL else 1
    # Ranges start on multiples of 1024 elements, so packed bits start on a byte.
    step = -(-n // parts)
    step = -(-step // 1024) * 1024
    return [(start, min(step, n - start)) for start in range(0, n, step)] or [(0, 0)]


def _parallel(n: int, call: Callable[[int, int, int], None]) -> int:
    """Run ``call(index, start, count)`` over the ranges covering ``[0, n)``; returns how many."""
    global _pool, _pool_size
    ranges = _ranges(n)
    if len(ranges) == 1:
        call(0, *ranges[0])
        return 1
    if _pool is None or _pool_size < len(ranges):
        _pool = ThreadPoolExecutor(max_workers=len(ranges), thread_name_prefix="grace-native")
        _pool_size = len(ranges)
    futures = [_pool.submit(call, i, start, count) for i, (start, count) in enumerate(ranges)]
    for future in futures:
        future.result()
    return len(ranges)


def split_key(seed: int) -> tuple[int, int]:
    """The two 32-bit words of a 64-bit seed, the key of ``counter_uniform``."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def _require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"grace.native is not available: {_error}")
    return lib


# --- the kernels, over raw addresses (ints) --------------------------------------------------------
def uniform(out: int, n: int, seed: int) -> None:
    lib = _require()
    k0, k1 = split_key(seed)
    _parallel(n, lambda _, start, count: lib.grace_uniform(k0, k1, start, count, out + 4 * start))


def quantize_levels(x: int, n: int, divisor: float, levels: float, seed: int, bits: int,
                    out: int) -> None:
    lib = _require()
    k0, k1 = split_key(seed)
    _parallel(n, lambda _, start, count: lib.grace_quantize_levels(
        x, start, count, divisor, levels, k0, k1, bits, out + start * bits // 8))


def sign_bits(x: int, n: int, out: int, stats: bool = False) -> tuple[float, float, float] | None:
    lib = _require()
    partial = (ctypes.c_double * 3 * (threads() + 1))()

    def call(index, start, count):
        lib.grace_sign_bits(x, start, count, out + start // 8,
                             ctypes.addressof(partial[index]) if stats else None)

    used = _parallel(n, call)
    if not stats:
        return None
    return tuple(sum(partial[i][j] for i in range(used)) for j in range(3))


def unpack_values(packed: int, bits: int, n: int, values: int, out: int) -> None:
    lib = _require()
    _parallel(n, lambda _, start, count: lib.grace_unpack_values(packed, bits, start, count, values,
                                                               out))


def sums(x: int, n: int) -> tuple[float, float, float]:
    """Float64 sum, float64 sum of squares, and the largest magnitude of float32 ``x``."""
    lib = _require()
    partial = (ctypes.c_double * 3 * (threads() + 1))()

    def call(index, start, count):
        lib.grace_sums(x, start, count, ctypes.addressof(partial[index]))

    used = _parallel(n, call)
    tops = [partial[i][2] for i in range(used)]
    top = math.nan if any(math.isnan(t) for t in tops) else max(tops)
    return sum(partial[i][0] for i in range(used)), sum(partial[i][1] for i in range(used)), top


def scaled_sum(a: int | None, alpha: float, b: int, beta: float, n: int, out: int) -> None:
    """``out = a * alpha + b * beta`` in float32 (``b * beta`` where ``a`` is None)."""
    lib = _require()
    _parallel(n, lambda _, start, count: lib.grace_scaled_sum(a, alpha, b, beta, start, count, out))


def select_above(x: int, n: int, threshold: float, out: int, cap: int) -> list[int]:
    """For each range of ``[0, n)``, the int32 indices ``i`` with ``|x[i]| >= threshold``, written to
    ``out + 4 * cap * range_index``, at most ``cap`` per range; returns each range's count (a count
    over ``cap`` means that range's list is cut short)."""
    lib = _require()
    counts = [0] * (threads() + 1)

    def call(index, start, count):
        counts[index] = lib.grace_select_above(x, start, count, threshold, out + 4 * cap * index, cap)

    return counts[:_parallel(n, call)]
