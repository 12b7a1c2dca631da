"""Fused CPU loops for float32 gradients, shared by every framework adapter.

The composite Ops code of an algorithm makes several passes over a gradient and a full-size temporary
for each step (|x|, the level, the random draws, the codes); on a CPU that costs many times a copy of
the tensor. ``kernels.c`` does each of the heavy steps in one pass, giving the same bits as the
composite code (``tests/test_native.py`` checks that). It is plain C with no framework headers, so
one build serves torch, TensorFlow (through ``tf.numpy_function``) and numpy alike: the adapters pass
raw pointers through ``ctypes``, which releases the GIL, and disjoint ranges of a large tensor run on
a few Python threads at once.

The library is compiled on first use with the system's C compiler (``$CC``, else ``cc``) and cached
under ``$GRACE_NATIVE_CACHE`` (else ``$GRACE_CACHE``, else ``~/.cache/grace``), keyed by the source,
the flags and the CPU's features (it is built with ``-march=native``). Without a compiler, or with
``GRACE_NATIVE=0``, ``available()`` is false and the adapters keep their composite code: the same
results, more slowly. ``GRACE_NATIVE_THREADS`` sets the number of threads (default: the CPUs this
process may run on).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, NamedTuple

import numpy as np

from grace.dtypes import index_dtype

MIN_NUMEL = 1 << 12
"""Adapters use the kernels from this many elements; below it the composite code costs as little."""

CROSSING_MIN_NUMEL = 1 << 16
"""The same for an adapter whose every call crosses into the host at a fixed cost (TensorFlow's
``tf.numpy_function``: tens of microseconds, which its own kernels beat on smaller tensors).
Measured in pairs within one process (``scripts/crossing.py``, docs/performance.md): from 2¹⁶
rather than 2¹⁸, TensorFlow's EF-signSGD step on ResNet-50's gradients took 0.80 of the time at one
worker and 0.86 at two, 1-bit 0.82, QSGD 0.92, top-k 0.83; random-k and DGC stayed within the
noise. From 2¹⁴ gained nothing more and cost DGC 9%."""

MAX_CODE_BITS = 8
"""The loops handle codes of up to this many bits (a code is a byte there)."""

KERNEL_DTYPES = ("float32",)
"""What the loops read; the fused encoders and decoders also take their packed ``uint8`` input."""


def worth_running(numel: int | None, dtypes, on_host: bool = True, contiguous: bool = True,
                  crossing: bool = False, accept: tuple[str, ...] = KERNEL_DTYPES) -> bool:
    """The one policy that decides, for every adapter, whether a loop runs instead of the
    composite code: a size known when it is decided, at least ``MIN_NUMEL`` elements
    (``CROSSING_MIN_NUMEL`` where each call crosses into the host), inputs of the ``accept``
    dtypes, in host memory and contiguous, and the library built."""
    threshold = CROSSING_MIN_NUMEL if crossing else MIN_NUMEL
    return (numel is not None and numel >= threshold and on_host and contiguous
            and all(d in accept for d in dtypes) and available())

PARALLEL_NUMEL = 1 << 19
"""From this many elements a kernel's range is split between threads."""

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
    cache = (os.environ.get("GRACE_NATIVE_CACHE") or os.environ.get("GRACE_CACHE")
             or os.path.join(os.path.expanduser("~"), ".cache", "grace"))
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
        "grace_quantize_levels": [ptr, i64, i64, ptr, i64, f32, u32, u32, ctypes.c_int, ptr],
        "grace_block_sums": [ptr, i64, i64, i64, i64, i64, ptr],
        "grace_unpack_blocks": [ptr, ctypes.c_int, i64, i64, ptr, i64, ptr, ptr],
        "grace_sign_bits": [ptr, i64, i64, ptr],
        "grace_unpack_values": [ptr, ctypes.c_int, i64, i64, ptr, ptr],
        "grace_sums": [ptr, i64, i64, ptr],
        "grace_scaled_sum": [ptr, f32, ptr, f32, i64, i64, ptr],
        "grace_count_above": [ptr, i64, i64, f32],
        "grace_select_above": [ptr, i64, i64, f32, ptr, ctypes.c_int],
        "grace_topk": [ptr, i64, i64, ptr, ctypes.c_int],
        "grace_choose": [u32, u32, i64, i64, ctypes.c_int, ptr, ctypes.c_int],
        "grace_scatter_add": [ptr, i64, ptr, ctypes.c_int, ptr, i64],
        "grace_two_sided": [ptr, i64, i64, f32, f32, ptr, ptr, ptr],
        "grace_inceptionn_encode": [ptr, i64, i64, f32, ptr, ptr, ptr, ptr, ptr],
        "grace_count_tags": [ptr, i64, i64, ptr],
        "grace_bucket_index": [ptr, ctypes.c_int32, ctypes.c_int, ptr, ptr],
        "grace_inceptionn_decode": [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, f32, ptr],
        "grace_natural_encode": [ptr, i64, i64, u32, u32, ptr, ptr],
        "grace_natural_decode": [ptr, ptr, i64, i64, ptr],
        "grace_magnitude_buckets": [ptr, i64, i64, f32, ptr, ptr, ptr, ctypes.c_int, ptr],
        "grace_bucketize_sums": [ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int32, ptr, ptr,
                                 ptr],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = (ctypes.c_int64 if name in ("grace_count_above", "grace_scatter_add", "grace_topk",
                                                  "grace_choose")
                      else None)


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


_disabled = 0


def available() -> bool:
    return _disabled == 0 and library() is not None


@contextmanager
def disabled():
    """Within the block the adapters see no library and run their composite code (for comparing
    the two in one process)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def reason() -> str | None:
    """Why the kernels are not in use, or ``None`` when they are."""
    library()
    return _error


def threads() -> int:
    """How many threads a large kernel call uses: ``GRACE_NATIVE_THREADS``, else
    ``OMP_NUM_THREADS`` (the framework's own kernels use that many: a job that gives each worker
    one core says so there), else the CPUs this process may run on (read once; the affinity query
    is a system call)."""
    for variable in ("GRACE_NATIVE_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(variable, "").strip()
        if value.isdigit():
            return max(1, int(value))
    return _cpus()


@functools.lru_cache(maxsize=1)
def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _ranges(n: int) -> list[tuple[int, int]]:
    if n < PARALLEL_NUMEL:
        return [(0, n)]
    parts = threads()
    # Ranges start on multiples of 1024 elements, so packed bits start on a byte.
    step = -(-n // parts)
    step = -(-step // 1024) * 1024
    return [(start, min(step, n - start)) for start in range(0, n, step)] or [(0, 0)]


def _block_ranges(n: int, block: int) -> list[tuple[int, int]]:
    """``_ranges(n)`` as whole blocks of ``block`` elements: (first block, number of blocks)."""
    count = -(-n // block)
    edges = sorted({min(-(-start // block), count) for start, _ in _ranges(n)} | {count})
    return [(a, b - a) for a, b in zip(edges, edges[1:])] or [(0, 0)]


def _parallel(n: int, call: Callable[[int, int, int], None], ranges: list | None = None) -> int:
    """Run ``call(index, start, count)`` over the ranges covering ``[0, n)`` (or over ``ranges``);
    returns how many."""
    global _pool, _pool_size
    ranges = _ranges(n) if ranges is None else ranges
    if len(ranges) == 1:
        call(0, *ranges[0])
        return 1
    if _pool is None or _pool_size < len(ranges) - 1:
        _pool = ThreadPoolExecutor(max_workers=len(ranges) - 1, thread_name_prefix="grace-native")
        _pool_size = len(ranges) - 1
    # The calling thread runs the first range itself: a hand-off to a waiting thread costs far more
    # than the loop over a range of moderate size.
    futures = [_pool.submit(call, i, start, count) for i, (start, count) in enumerate(ranges) if i]
    call(0, *ranges[0])
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


# --- the kernels, over numpy arrays (host memory), shared by the torch and TensorFlow adapters -----
# Each allocates its outputs (see _empty) and returns them.
ALIGNED_BYTES = 1 << 16
"""Outputs from this size on start on 64 bytes (see ``_empty``)."""


def _empty(n: int, dtype, allocate=np.empty) -> np.ndarray:
    """An uninitialised array whose data starts on 64 bytes from ``ALIGNED_BYTES``: TensorFlow
    adopts such an array as a tensor without copying it (it copies one that is not aligned for
    Eigen, which for a small array costs less than aligning it)."""
    itemsize = np.dtype(dtype).itemsize
    if n * itemsize < ALIGNED_BYTES:
        return allocate(n, dtype)
    raw = allocate(n * itemsize + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset:offset + n * itemsize].view(dtype)


def empty(n: int, dtype) -> np.ndarray:
    return _empty(n, dtype)


def zeros(n: int, dtype) -> np.ndarray:
    """As ``empty``, holding zeros: fresh pages from the kernel, with no pass to clear them."""
    return _empty(n, dtype, np.zeros)


def uniform(n: int, seed: int) -> np.ndarray:
    """``n`` float32 draws from [0, 1): ``grace.rng.counter_uniform_bits`` for ``seed``."""
    lib = _require()
    k0, k1 = split_key(seed)
    out = _empty(n, np.float32)
    _parallel(n, lambda _, start, count: lib.grace_uniform(k0, k1, start, count,
                                                           out.ctypes.data + 4 * start))
    return out


def quantize_levels(x: np.ndarray, divisors: np.ndarray, seed: int, levels: int, bits: int,
                    block: int) -> np.ndarray:
    """``grace.steps.quantize_levels`` for float32 ``x``, each block of ``block`` elements against its own
    float32 divisor: the packed sign-magnitude codes."""
    lib = _require()
    n = x.size
    k0, k1 = split_key(seed)
    divisors = np.ascontiguousarray(divisors, np.float32)
    out = _empty((n * bits + 7) // 8, np.uint8)
    _parallel(n, lambda _, start, count: lib.grace_quantize_levels(
        x.ctypes.data, start, count, divisors.ctypes.data, block, float(levels), k0, k1, bits,
        out.ctypes.data + start * bits // 8))
    return out


def block_sums(x: np.ndarray, block: int) -> np.ndarray:
    """Per block of ``block`` elements of float32 ``x``: the count of x >= 0, the float64 sums of
    those and of the others, and the sum of squares, as a (4, blocks) float64 array."""
    lib = _require()
    n = x.size
    total = -(-n // block)
    out = np.empty((4, total), np.float64)
    _parallel(n, lambda _, first, count: lib.grace_block_sums(
        x.ctypes.data, n, block, first, count, total, out.ctypes.data), _block_ranges(n, block))
    return out


def unpack_blocks(packed: np.ndarray, tables: np.ndarray, bits: int, n: int, block: int) -> np.ndarray:
    """``tables[i // block, code]`` (float32) for each of the ``n`` codes of ``bits`` bits packed."""
    return _unpack_blocks(packed, tables, None, bits, n, block)


def unpack_blocks_onto(packed: np.ndarray, tables: np.ndarray, base: np.ndarray, bits: int, n: int,
                       block: int) -> np.ndarray:
    """``base + unpack_blocks(...)`` (float32), in one pass."""
    return _unpack_blocks(packed, tables, np.ascontiguousarray(base, np.float32), bits, n, block)


def _unpack_blocks(packed, tables, base, bits, n, block):
    lib = _require()
    tables = np.ascontiguousarray(tables, np.float32)
    out = _empty(n, np.float32)
    onto = None if base is None else base.ctypes.data
    _parallel(n, lambda _, start, count: lib.grace_unpack_blocks(
        packed.ctypes.data, bits, start, count, tables.ctypes.data, block, onto, out.ctypes.data))
    return out


def sign_bits(x: np.ndarray) -> np.ndarray:
    """``grace.steps.sign_bits`` for float32 ``x``: 1 where x >= 0, packed."""
    lib = _require()
    n = x.size
    out = _empty((n + 7) // 8, np.uint8)
    _parallel(n, lambda _, start, count: lib.grace_sign_bits(
        x.ctypes.data, start, count, out.ctypes.data + start // 8))
    return out


def unpack_values(packed: np.ndarray, values: np.ndarray, bits: int, n: int) -> np.ndarray:
    """``values[code]`` (float32 ``values``) for each of the ``n`` codes of ``bits`` bits packed."""
    lib = _require()
    out = _empty(n, np.float32)
    _parallel(n, lambda _, start, count: lib.grace_unpack_values(
        packed.ctypes.data, bits, start, count, values.ctypes.data, out.ctypes.data))
    return out


def sums(x: np.ndarray) -> tuple[float, float, float]:
    """Float64 sum, float64 sum of squares, and the largest magnitude of float32 ``x``."""
    lib = _require()
    x = np.ascontiguousarray(x)
    partial = np.zeros((threads() + 1, 3))
    used = _parallel(x.size, lambda index, start, count: lib.grace_sums(
        x.ctypes.data, start, count, partial[index].ctypes.data))
    if used == 1:  # the common case of a small tensor, without the reductions below
        total, squares, top = partial[0].tolist()
        return total, squares, top
    tops = partial[:used, 2]
    top = math.nan if np.isnan(tops).any() else float(tops.max())
    return float(partial[:used, 0].sum()), float(partial[:used, 1].sum()), top


def scaled_sum(*arrays: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """``a * alpha + b * beta`` in float32 for ``arrays`` = (a, b), or ``b * beta`` for (b,), shaped
    as ``b``."""
    lib = _require()
    b = arrays[-1]
    a = arrays[0].ctypes.data if len(arrays) == 2 else None
    out = _empty(b.size, np.float32)
    _parallel(b.size, lambda _, start, count: lib.grace_scaled_sum(
        a, alpha, b.ctypes.data, beta, start, count, out.ctypes.data))
    return out.reshape(b.shape)


_BUCKET_INDEXES: dict = {}


def _bucket_index(boundaries: np.ndarray, key_bits: int = 16
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Ascending float32 boundaries (with +inf after them), and for each value of a float32's top
    ``key_bits`` bits the range [low, high] that holds the count of boundaries <= any float with
    those bits; and the shift that takes a float's bits to its key. Built by a C sweep over the keys
    (about 0.35 ms for 16 bits, 0.1 ms for 14, whose ranges are wider); the last few are kept
    (u8bit's boundaries never change)."""
    shift = 32 - key_bits
    cache_key = (np.asarray(boundaries, np.float32).tobytes(), shift)
    if cache_key in _BUCKET_INDEXES:
        return _BUCKET_INDEXES[cache_key]
    # One slot past the end, so that reading boundaries[high] is always in bounds.
    table = np.append(np.asarray(boundaries, np.float32), np.float32(np.inf))
    low, high = np.empty(1 << key_bits, np.int32), np.empty(1 << key_bits, np.int32)
    _require().grace_bucket_index(table.ctypes.data, len(table) - 1, shift, low.ctypes.data,
                                  high.ctypes.data)
    if len(_BUCKET_INDEXES) >= 8:
        _BUCKET_INDEXES.pop(next(iter(_BUCKET_INDEXES)))
    _BUCKET_INDEXES[cache_key] = (table, low, high, shift)
    return table, low, high, shift


def indices_at_least(x: np.ndarray, threshold: float, dtype=np.int64) -> np.ndarray:
    """The indices (``dtype``: int32 or int64) of float32 ``x`` with ``|x| >= threshold``, in order."""
    lib = _require()
    n, address = x.size, x.ctypes.data
    wide = int(np.dtype(dtype) == np.int64)
    itemsize = 8 if wide else 4
    ranges = _ranges(n)
    counts = [0] * len(ranges)

    def count(index, start, size):
        counts[index] = lib.grace_count_above(address, start, size, threshold)

    _parallel(n, count)
    # Each range writes from its own offset: the counts before it.
    offsets = [int(sum(counts[:i])) for i in range(len(ranges))]
    out = _empty(sum(counts), dtype)
    _parallel(n, lambda index, start, size: lib.grace_select_above(
        address, start, size, threshold, out.ctypes.data + itemsize * offsets[index], wide))
    return out


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` indices of float32 ``x`` of largest magnitude, ascending, in ``index_dtype``;
    where magnitudes tie at the k-th, the lowest indices (``Ops.topk_indices``)."""
    lib = _require()
    dtype = np.dtype(index_dtype(x.size))
    if k >= x.size or k <= 0:
        return np.arange(min(max(k, 0), x.size), dtype=dtype)
    out = _empty(k, dtype)
    if lib.grace_topk(x.ctypes.data, x.size, k, out.ctypes.data, int(dtype == np.int64)) != 0:
        raise MemoryError(f"grace.native.topk_indices: no memory for the candidates of {x.size} elements")
    return out


def choose_indices(n: int, k: int, seed: int) -> np.ndarray:
    """``grace.rng.reference_indices(n, k, seed)``: ``k`` distinct indices of ``[0, n)``, uniform,
    ascending, in ``index_dtype``."""
    lib = _require()
    dtype = np.dtype(index_dtype(n))
    out = _empty(k, dtype)
    k0, k1 = split_key(seed)
    complement = k > n - k  # draw the smaller of the set and what it leaves out
    status = lib.grace_choose(k0, k1, n, n - k if complement else k, int(complement),
                              out.ctypes.data, int(dtype == np.int64))
    if status == -1:
        raise MemoryError(f"grace.native.choose_indices: no memory for a bitmap of {n} elements")
    if status == -2:
        raise ValueError(f"grace.native.choose_indices: n must be below 2**31, got {n}")
    return out


def count_at_least(x: np.ndarray, threshold: float) -> int:
    """How many elements of float32 ``x`` have ``|x| >= threshold``."""
    lib = _require()
    counts = [0] * (threads() + 1)

    def count(index, start, size):
        counts[index] = lib.grace_count_above(x.ctypes.data, start, size, threshold)

    return sum(counts[:_parallel(x.size, count)])


def scatter_add(n: int, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A float32 array of ``n`` zeros with ``values`` added at ``indices`` (int32 or int64)."""
    lib = _require()
    indices, values = np.ascontiguousarray(indices), np.ascontiguousarray(values, np.float32)
    if indices.size != values.size:
        raise ValueError(f"scatter_add: {indices.size} indices for {values.size} values")
    out = zeros(n, np.float32)
    bad = lib.grace_scatter_add(out.ctypes.data, n, indices.ctypes.data,
                                int(indices.dtype == np.int64), values.ctypes.data, values.size)
    if bad >= 0:
        raise IndexError(f"scatter_add: index {int(indices[bad])} is out of range for {n} elements")
    return out


def zeroed_copy(x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """A copy of 1-d ``x`` with zeros at ``indices`` (repeated ones allowed), in memory TensorFlow
    adopts without a further copy (``_empty``): one copy and ``k`` stores, where TensorFlow's
    ``tensor_scatter_nd_update`` took twice a copy's time on a gradient (docs/performance.md)."""
    out = _empty(x.size, x.dtype)
    np.copyto(out, x.reshape(-1))
    out[np.asarray(indices)] = 0
    return out


def zero_in_place(x: np.ndarray, indices: np.ndarray, *after: np.ndarray) -> np.ndarray:
    """1-d ``x`` with zeros at ``indices``, written where it is (no copy), for a tensor nothing
    reads afterwards; ``after``: inputs that order the call after their computation, unused. A
    read-only ``x`` gets ``zeroed_copy`` instead."""
    if not x.flags.writeable:
        return zeroed_copy(x, indices)
    out = x.reshape(-1)
    out[np.asarray(indices)] = 0
    return out


def two_sided(x: np.ndarray, top: np.ndarray, bottom: np.ndarray):
    """AdaQ's selection: the indices (int64, in order) of ``x >= top`` among the positive elements
    and of ``x <= bottom`` among the negative ones, and their float64 sums and counts."""
    lib = _require()
    n, address = x.size, x.ctypes.data
    t, b = _value(top), _value(bottom)
    ranges = _ranges(n)
    counts = np.zeros((len(ranges), 2), np.int64)
    _parallel(n, lambda index, start, size: lib.grace_two_sided(
        address, start, size, t, b, None, None, counts[index].ctypes.data))
    offsets = np.zeros((len(ranges), 2), np.int64)
    offsets[1:] = np.cumsum(counts + 1, axis=0)[:-1]
    total = counts.sum(0) + len(ranges)
    high, low = _empty(int(total[0]), np.int64), _empty(int(total[1]), np.int64)
    scratch = np.zeros((len(ranges), 2), np.int64)
    _parallel(n, lambda index, start, size: lib.grace_two_sided(
        address, start, size, t, b, high.ctypes.data + 8 * int(offsets[index, 0]),
        low.ctypes.data + 8 * int(offsets[index, 1]), scratch[index].ctypes.data))
    pick = [np.concatenate([out[o:o + c] for o, c in zip(offsets[:, j], counts[:, j])])
            for j, out in enumerate((high, low))]
    # The sums run over the few selected elements only, in index order.
    sums = np.array([x[i].sum(dtype=np.float64) for i in pick])
    return pick[0], pick[1], sums, counts.sum(0).astype(np.float64)


def inceptionn_encode(x: np.ndarray, inverse: np.ndarray):
    """INCEPTIONN's tags (2 bits, packed) and class members (int8 and int16 steps, float32 values)
    for float32 ``x`` with ``steps = rint(x * inverse)``."""
    lib = _require()
    n, address = x.size, x.ctypes.data
    inv = _value(inverse)
    ranges = _ranges(n)
    counts = np.zeros((len(ranges), 3), np.int64)
    _parallel(n, lambda index, start, size: lib.grace_inceptionn_encode(
        address, start, size, inv, None, None, None, None, counts[index].ctypes.data))
    offsets = np.zeros((len(ranges), 3), np.int64)
    offsets[1:] = np.cumsum(counts, axis=0)[:-1]
    total = counts.sum(0)
    tags = _empty((n + 3) // 4, np.uint8)
    small, medium = _empty(int(total[0]), np.int8), _empty(int(total[1]), np.int16)
    large = _empty(int(total[2]), np.float32)
    scratch = np.zeros((len(ranges), 3), np.int64)
    _parallel(n, lambda index, start, size: lib.grace_inceptionn_encode(
        address, start, size, inv, tags.ctypes.data + start // 4,
        small.ctypes.data + int(offsets[index, 0]), medium.ctypes.data + 2 * int(offsets[index, 1]),
        large.ctypes.data + 4 * int(offsets[index, 2]), scratch[index].ctypes.data))
    return tags, small, medium, large


def inceptionn_decode(tags: np.ndarray, small: np.ndarray, medium: np.ndarray, large: np.ndarray,
                      error_bound: np.ndarray, n: int) -> np.ndarray:
    lib = _require()
    out = _empty(n, np.float32)
    ranges = _ranges(n)
    counts = np.zeros((len(ranges), 3), np.int64)
    _parallel(n, lambda index, start, size: lib.grace_count_tags(
        tags.ctypes.data, start, size, counts[index].ctypes.data))
    offsets = np.zeros((len(ranges), 3), np.int64)
    offsets[1:] = np.cumsum(counts, axis=0)[:-1]
    tagged, members = tuple(int(c) for c in counts.sum(0)), (small.size, medium.size, large.size)
    if tagged != members:
        raise ValueError(f"inceptionn payload: its tags count {tagged} members of classes 1, 2, 3, "
                         f"but it holds {members}")
    bound = _value(error_bound)
    _parallel(n, lambda index, start, size: lib.grace_inceptionn_decode(
        tags.ctypes.data, start, size, small.ctypes.data, medium.ctypes.data, large.ctypes.data,
        *(int(o) for o in offsets[index]), bound, out.ctypes.data))
    return out


def _value(a) -> float:
    return float(np.reshape(a, -1)[0])


def natural_encode(x: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    lib = _require()
    n = x.size
    k0, k1 = split_key(seed)
    codes, signs = _empty(n, np.uint8), _empty((n + 7) // 8, np.uint8)
    _parallel(n, lambda _, start, count: lib.grace_natural_encode(
        x.ctypes.data, start, count, k0, k1, codes.ctypes.data, signs.ctypes.data + start // 8))
    return codes, signs


def natural_decode(codes: np.ndarray, signs: np.ndarray) -> np.ndarray:
    lib = _require()
    n = codes.size
    out = _empty(n, np.float32)
    _parallel(n, lambda _, start, count: lib.grace_natural_decode(
        codes.ctypes.data, signs.ctypes.data, start, count, out.ctypes.data))
    return out


def magnitude_buckets(x: np.ndarray, divisor: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """For float32 ``x``: how many ``boundaries`` are <= ``|x| / divisor``, plus 128 where x < 0."""
    lib = _require()
    n = x.size
    table, low, high, shift = _bucket_index(boundaries)
    out = _empty(n, np.uint8)
    d = _value(divisor)
    _parallel(n, lambda _, start, count: lib.grace_magnitude_buckets(
        x.ctypes.data, start, count, d, table.ctypes.data, low.ctypes.data, high.ctypes.data, shift,
        out.ctypes.data))
    return out


def bucketize_sums(x: np.ndarray, boundaries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For float32 ``x``: each element's bucket (how many of at most 255 ``boundaries`` are <= it)
    as a byte, and per bucket the float64 sum and count of its elements."""
    lib = _require()
    n = x.size
    table, low, high, shift = _bucket_index(boundaries, 16 if n >= 1 << 17 else 14)
    ids = _empty(n, np.uint8)
    buckets = len(table)
    parts = len(_ranges(n))
    sums, counts = np.zeros((parts, buckets)), np.zeros((parts, buckets))
    _parallel(n, lambda index, start, count: lib.grace_bucketize_sums(
        x.ctypes.data, start, count, table.ctypes.data, low.ctypes.data, high.ctypes.data, shift, buckets,
        ids.ctypes.data, sums[index].ctypes.data, counts[index].ctypes.data))
    return ids, sums.sum(0), counts.sum(0)


class Kernel(NamedTuple):
    """One loop of ``kernels.c`` as ``grace.kernels`` runs it in place of a composite step."""

    loop: Callable
    """The loop over numpy arrays: the inputs, then the seed where it draws random numbers, then
    keyword parameters (plain numbers); one array or a tuple of them."""
    outputs: Callable
    """The outputs' (dtype, shape) from the inputs' shapes and the parameters (None in a shape:
    known only when it runs). The loop returns arrays of exactly these shapes: a traced graph takes
    them as its static shapes."""
    accepts: Callable = lambda dtypes, **params: True
    """Whether the loop takes inputs of these dtypes with these parameters, beyond the first
    input's dtype (float32, or uint8 for a decoder), which the policy checks."""


def _float32(*positions: int) -> Callable:
    """An ``accepts`` for loops that read the inputs at ``positions`` as float32."""
    return lambda dtypes, **params: all(dtypes[i] == "float32" for i in positions)


def _whole_codes(dtypes, bits, **params) -> bool:
    return 8 % bits == 0 and dtypes[1] == "float32"


def _top_k_outputs(x, k, **params) -> list:
    """The top-k kernels' output: ``min(k, n)`` indices of ``index_dtype(n)``."""
    return [(index_dtype(x[0]), (min(k, x[0]),))]


KERNELS: dict[str, Kernel] = {
    "quantize_levels": Kernel(quantize_levels, lambda x, divisors, levels, bits, block: [
        ("uint8", ((x[0] * bits + 7) // 8,))], lambda dtypes, bits, **params: bits <= MAX_CODE_BITS),
    "block_sums": Kernel(block_sums, lambda x, block: [("float64", (4, -(-x[0] // block)))],
                         _float32(0)),
    "unpack_blocks": Kernel(unpack_blocks, lambda packed, tables, bits, n, block: [("float32", (n,))],
                            _whole_codes),
    "unpack_blocks_onto": Kernel(unpack_blocks_onto,
                                 lambda packed, tables, base, bits, n, block: [("float32", (n,))],
                                 lambda dtypes, bits, **params: _whole_codes(dtypes, bits)
                                 and dtypes[2] == "float32"),
    "sign_bits": Kernel(sign_bits, lambda x: [("uint8", ((x[0] + 7) // 8,))], _float32(0)),
    "unpack_values": Kernel(unpack_values, lambda packed, values, bits, n: [("float32", (n,))],
                            lambda dtypes, bits, **params: bits <= MAX_CODE_BITS
                            and dtypes[1] == "float32"),
    "scaled_sum": Kernel(scaled_sum, lambda *shapes, alpha, beta: [("float32", shapes[-1])],
                         lambda dtypes, **params: all(d == "float32" for d in dtypes)),
    "natural_encode": Kernel(natural_encode, lambda x: [("uint8", x), ("uint8", ((x[0] + 7) // 8,))],
                             _float32(0)),
    "natural_decode": Kernel(natural_decode, lambda codes, signs: [("float32", codes)]),
    "magnitude_buckets": Kernel(magnitude_buckets, lambda x, divisor, boundaries: [("uint8", x)],
                                _float32(0, 1, 2)),
    "two_sided": Kernel(two_sided, lambda x, top, bottom: [
        ("int64", (None,)), ("int64", (None,)), ("float64", (2,)), ("float64", (2,))], _float32(0, 1, 2)),
    "inceptionn_encode": Kernel(inceptionn_encode, lambda x, inverse: [
        ("uint8", ((x[0] + 3) // 4,)), ("int8", (None,)), ("int16", (None,)), ("float32", (None,))],
        _float32(0)),
    "inceptionn_decode": Kernel(inceptionn_decode, lambda *shapes, n: [("float32", (n,))],
                                _float32(3, 4)),
    "exact_top_k": Kernel(topk_indices, _top_k_outputs, _float32(0)),
    # DGC's selection is the exact top-k too: its random sample only speeds the composite code up.
    "sampled_top_k": Kernel(lambda x, seed, k, m: topk_indices(x, k), _top_k_outputs, _float32(0)),
    "bucketize_sums": Kernel(bucketize_sums, lambda x, boundaries: [
        ("uint8", x), ("float64", (boundaries[0] + 1,)), ("float64", (boundaries[0] + 1,))],
        _float32(0, 1)),
}
"""The loops ``grace.kernels`` may run in place of the composite steps named alike: the protocol's
shared steps (``grace.steps``) and single algorithms' encoders and decoders."""


def run_kernel(kernel: str, arrays: list, seed: int | None = None, **params):
    """``KERNELS[kernel]`` on contiguous arrays (and ``params``, plain numbers), as a tuple of arrays."""
    loop = KERNELS[kernel].loop
    arrays = [np.ascontiguousarray(a) for a in arrays]
    result = loop(*arrays, seed, **params) if seed is not None else loop(*arrays, **params)
    return result if isinstance(result, tuple) else (result,)
