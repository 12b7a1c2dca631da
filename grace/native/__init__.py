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
Measured in pairs within one process (``scripts/studies/crossing.py``, docs/performance.md): from 2¹⁶
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

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "kernels.c")
_HEADER = os.path.join(_HERE, "common.h")
_COMPRESSORS = os.path.join(os.path.dirname(_HERE), "compressors")
_FLAGS = ["-O3", "-march=native", "-std=c11", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math", "-fPIC",
          "-shared"]


def sources() -> list[str]:
    """The library's C files: the shared steps (``kernels.c``) and each compressor's own loops,
    beside its module in grace/compressors/ (``natural.c`` beside ``natural.py``)."""
    return [_SOURCE] + sorted(os.path.join(_COMPRESSORS, name) for name in os.listdir(_COMPRESSORS)
                              if name.endswith(".c"))

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
    files = sources()
    digest = hashlib.sha256()
    for path in [_HEADER, *files]:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    key = hashlib.sha256(digest.digest() + " ".join([compiler, *_FLAGS, _cpu_features()]).encode()
                         ).hexdigest()
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
            subprocess.run([compiler, *_FLAGS, "-I", _HERE, *files, "-o", tmp, "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; ``None`` where they cannot be had (see ``reason``)."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib
    if os.environ.get("GRACE_NATIVE", "1") == "0":
        _error = "disabled by GRACE_NATIVE=0"
        return None
    try:
        _lib = ctypes.CDLL(_build())
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        _error = f"could not build {', '.join(sources())}: {detail.strip()[:500]}"
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


def parts(n: int) -> int:
    """How many ranges a loop over ``n`` elements runs in (the rows of its partial results)."""
    return len(_ranges(n))


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


# --- loops declared once, and the one caller of them ------------------------------------------
class Arg(NamedTuple):
    """One argument of a C loop: its ctypes type, and its value in one range's call,
    ``value(run, index, start, count)`` (``run``: the call's ``_Run``)."""

    ctype: object
    value: Callable


class _Run(NamedTuple):
    """What every range's call of one ``run`` shares, its arrays' addresses read once."""

    ins: list  # the inputs' data addresses (None for an input given as None)
    outs: list  # the outputs' data addresses (None for an output given as None)
    row_bytes: list  # the outputs' first strides (a Row's step)
    itemsizes: list
    params: dict
    key: tuple[int, int]
    offsets: np.ndarray | None  # a selecting loop's writing pass: where each range writes


_I64, _U32, _F32, _PTR = ctypes.c_int64, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p
INT, INT32 = ctypes.c_int, ctypes.c_int32
"""The C ``int`` and ``int32_t`` of a ``Param`` (a float by default)."""
I64 = _I64
"""The C ``int64_t`` of a ``Param``."""


def In(i: int) -> Arg:  # noqa: N802 (a kind of argument, read in the declarations as one)
    """The data of the call's ``i``-th input array (``NULL`` for an input given as ``None``)."""
    return Arg(_PTR, lambda r, index, start, count: r.ins[i])


def Out(j: int) -> Arg:  # noqa: N802
    """The data of the ``j``-th output, which the loop writes at its elements' own positions
    (``NULL`` for an output given as ``None``: a selecting loop's counting pass)."""
    return Arg(_PTR, lambda r, index, start, count: r.outs[j])


def Row(j: int) -> Arg:  # noqa: N802
    """This range's row of the ``j``-th output (a partial result per range, reduced by the caller)."""
    return Arg(_PTR, lambda r, index, start, count: r.outs[j] + index * r.row_bytes[j])


def Placed(j: int, column: int | None = None) -> Arg:  # noqa: N802
    """A selecting loop's ``j``-th output: ``NULL`` while it counts, then where this range's
    selections go, after those of the ranges before it (its counts' ``column``, ``j`` unless
    given)."""
    column = j if column is None else column
    return Arg(_PTR, lambda r, index, start, count: None if r.offsets is None else
               r.outs[j] + r.itemsizes[j] * int(r.offsets[index, column]))


def Offset(column: int) -> Arg:  # noqa: N802
    """How many selections of counts' ``column`` the ranges before this one hold."""
    return Arg(_I64, lambda r, index, start, count: int(r.offsets[index, column]))


def Param(name: str, ctype=_F32) -> Arg:  # noqa: N802
    """The call's parameter ``name``, a plain number."""
    return Arg(ctype, lambda r, index, start, count: r.params[name])


START = Arg(_I64, lambda r, index, start, count: start)
"""The first element (or block) of the range."""
COUNT = Arg(_I64, lambda r, index, start, count: count)
"""The range's number of elements (or blocks)."""
KEY = (Arg(_U32, lambda r, index, start, count: r.key[0]),
       Arg(_U32, lambda r, index, start, count: r.key[1]))
"""The two words of the seed of a loop that draws (``split_key``)."""


class Loop(NamedTuple):
    """One loop of the C library, declared once: its symbol, its arguments in order (``In``,
    ``Out``, ``Row``, ``Placed``, ``Offset``, ``Param``, ``START``, ``COUNT``, ``KEY``) and what it
    returns."""

    symbol: str
    args: tuple
    restype: object = None


_functions: dict[str, Callable] = {}


def _function(loop: Loop) -> Callable:
    """The loaded symbol of ``loop``, its ctypes signature set from the declaration."""
    fn = _functions.get(loop.symbol)
    if fn is None:
        fn = getattr(_require(), loop.symbol)
        fn.argtypes = [arg.ctype for arg in loop.args]
        fn.restype = loop.restype
        _functions[loop.symbol] = fn
    return fn


def _address(a: np.ndarray | None) -> int | None:
    return None if a is None else a.__array_interface__["data"][0]


def run(loop: Loop, n: int, arrays: list, outputs: list, params: dict | None = None,
        seed: int | None = None, ranges: list | None = None, offsets: np.ndarray | None = None) -> list:
    """``loop`` over ``[0, n)``, split into ranges (``_ranges``, or ``ranges``) that threads run at
    once; returns each range's result (the loop's ``restype``)."""
    fn = _function(loop)
    shared = _Run([_address(a) for a in arrays], [_address(o) for o in outputs],
                  [0 if o is None or o.ndim < 2 else o.strides[0] for o in outputs],
                  [0 if o is None else o.itemsize for o in outputs], params or {},
                  split_key(seed) if seed is not None else (0, 0), offsets)
    ranges = _ranges(n) if ranges is None else ranges
    values = [arg.value for arg in loop.args]
    if len(ranges) == 1:  # the common case of a tensor of moderate size: no threads
        return [fn(*[value(shared, 0, *ranges[0]) for value in values])]
    results = [None] * len(ranges)

    def call(index: int, start: int, count: int) -> None:
        results[index] = fn(*[value(shared, index, start, count) for value in values])

    _parallel(n, call, ranges)
    return results


def placement(counts: np.ndarray, slack: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Where each range's selections start (``counts``: one row per range, one column per
    output), each range given ``slack`` spare slots, and each output's total."""
    offsets = np.zeros_like(counts)
    offsets[1:] = np.cumsum(counts + slack, axis=0)[:-1]
    return offsets, counts.sum(0) + slack * len(counts)


def select(loop: Loop, n: int, arrays: list, fixed: list, dtypes: list, params: dict | None = None,
           slack: int = 0) -> tuple[list, np.ndarray]:
    """A selecting loop over ``[0, n)``, its outputs the ``fixed`` arrays and then one of each of
    ``dtypes`` (its ``Placed`` ones), its counts its last ``Row``: each range counts its selections
    (the outputs ``NULL``), then writes them after those of the ranges before it, ``slack`` spare
    slots a range. Returns the outputs and the counts, one row per range."""
    counts = np.zeros((parts(n), len(dtypes)), np.int64)
    run(loop, n, arrays, [None] * (len(fixed) + len(dtypes)) + [counts], params)
    offsets, totals = placement(counts, slack)
    placed = [_empty(int(total), dtype) for total, dtype in zip(totals, dtypes)]
    run(loop, n, arrays, fixed + placed + [np.zeros_like(counts)], params, offsets=offsets)
    return fixed + placed, counts


# --- the shared steps' loops, over numpy arrays (host memory), for every adapter ----------------
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


def scalar(a) -> float:
    """The one value of a 1-element array (a loop's float parameter handed over as an input)."""
    return float(np.reshape(a, -1)[0])


UNIFORM = Loop("grace_uniform", (*KEY, START, COUNT, Out(0)))
QUANTIZE_LEVELS = Loop("grace_quantize_levels", (In(0), START, COUNT, In(1), Param("block", _I64),
                                                 Param("levels"), *KEY, Param("bits", INT), Out(0)))
BLOCK_SUMS = Loop("grace_block_sums", (In(0), Param("n", _I64), Param("block", _I64), START, COUNT,
                                       Param("total", _I64), Out(0)))
UNPACK_BLOCKS = Loop("grace_unpack_blocks", (In(0), Param("bits", INT), START, COUNT, In(1),
                                             Param("block", _I64), In(2), Out(0)))
SIGN_BITS = Loop("grace_sign_bits", (In(0), START, COUNT, Out(0)))
UNPACK_VALUES = Loop("grace_unpack_values", (In(0), Param("bits", INT), START, COUNT, In(1), Out(0)))
SUMS = Loop("grace_sums", (In(0), START, COUNT, Row(0)))
SCALED_SUM = Loop("grace_scaled_sum", (In(0), Param("alpha"), In(1), Param("beta"), START, COUNT,
                                       Out(0)))
WIDEN_SCALED = Loop("grace_widen_scaled", (In(0), Param("brain", INT32), Param("factor"), START, COUNT,
                                           Out(0)))
BF16_ROUND = Loop("grace_bf16_round", (In(0), START, COUNT, Out(0)))
BF16_ROWS_SUM = Loop("grace_bf16_rows_sum", (In(0), Param("workers", _I64), Param("n", _I64), START,
                                             COUNT, Out(0)))
COUNT_ABOVE = Loop("grace_count_above", (In(0), START, COUNT, Param("threshold")), _I64)
SELECT_ABOVE = Loop("grace_select_above", (In(0), START, COUNT, Param("threshold"), Placed(0),
                                           Param("wide", INT)))
SCATTER_ADD = Loop("grace_scatter_add", (Out(0), Param("n", _I64), In(0), Param("wide", INT), In(1),
                                         Param("k", _I64)), _I64)
TOPK = Loop("grace_topk", (In(0), Param("n", _I64), Param("k", _I64), Out(0), Param("wide", INT)), _I64)
CHOOSE = Loop("grace_choose", (*KEY, Param("n", _I64), Param("m", _I64), Param("complement", INT),
                               Out(0), Param("wide", INT)), _I64)
BIN_INDEX = Loop("grace_bin_index", (In(0), Param("count", INT32), Param("shift", INT),
                                           Out(0), Out(1)))


def once(loop: Loop, arrays: list, outputs: list, params: dict | None = None,
         seed: int | None = None):
    """``loop`` called once, over everything (a loop that does not split into ranges)."""
    return run(loop, 1, arrays, outputs, params, seed, ranges=[(0, 1)])[0]


def uniform(n: int, seed: int) -> np.ndarray:
    """``n`` float32 draws from [0, 1): ``grace.rng.counter_uniform_bits`` for ``seed``."""
    out = _empty(n, np.float32)
    run(UNIFORM, n, [], [out], seed=seed)
    return out


def quantize_levels(x: np.ndarray, divisors: np.ndarray, seed: int, levels: int, bits: int,
                    block: int) -> np.ndarray:
    """``grace.steps.quantize_levels`` for float32 ``x``, each block of ``block`` elements against its own
    float32 divisor: the packed sign-magnitude codes."""
    out = _empty((x.size * bits + 7) // 8, np.uint8)
    run(QUANTIZE_LEVELS, x.size, [x, np.ascontiguousarray(divisors, np.float32)], [out],
        {"block": block, "levels": float(levels), "bits": bits}, seed)
    return out


def block_sums(x: np.ndarray, block: int) -> np.ndarray:
    """Per block of ``block`` elements of float32 ``x``: the count of x >= 0, the float64 sums of
    those and of the others, and the sum of squares, as a (4, blocks) float64 array."""
    n = x.size
    total = -(-n // block)
    out = np.empty((4, total), np.float64)
    run(BLOCK_SUMS, n, [x], [out], {"n": n, "block": block, "total": total}, ranges=_block_ranges(n, block))
    return out


def unpack_blocks(packed: np.ndarray, tables: np.ndarray, bits: int, n: int, block: int) -> np.ndarray:
    """``tables[i // block, code]`` (float32) for each of the ``n`` codes of ``bits`` bits packed."""
    return unpack_blocks_onto(packed, tables, None, bits, n, block)


def unpack_blocks_onto(packed: np.ndarray, tables: np.ndarray, base: np.ndarray | None, bits: int, n: int,
                       block: int) -> np.ndarray:
    """``base + unpack_blocks(...)`` (float32), in one pass (no ``base``: ``unpack_blocks``)."""
    out = _empty(n, np.float32)
    base = None if base is None else np.ascontiguousarray(base, np.float32)
    run(UNPACK_BLOCKS, n, [packed, np.ascontiguousarray(tables, np.float32), base], [out],
        {"bits": bits, "block": block})
    return out


def sign_bits(x: np.ndarray) -> np.ndarray:
    """``grace.steps.sign_bits`` for float32 ``x``: 1 where x >= 0, packed."""
    out = _empty((x.size + 7) // 8, np.uint8)
    run(SIGN_BITS, x.size, [x], [out])
    return out


def unpack_values(packed: np.ndarray, values: np.ndarray, bits: int, n: int) -> np.ndarray:
    """``values[code]`` (float32 ``values``) for each of the ``n`` codes of ``bits`` bits packed."""
    out = _empty(n, np.float32)
    run(UNPACK_VALUES, n, [packed, values], [out], {"bits": bits})
    return out


def bf16_rows_sum(rows: np.ndarray, workers: int, n: int) -> np.ndarray:
    """The bfloat16 bits (int16) of the float32 sum, in rank order, of the ``workers`` rows of ``n``
    bfloat16 values given as their bits (``rows``: ``workers * n`` int16, row after row), rounded
    once to nearest even."""
    rows = np.ascontiguousarray(rows).reshape(-1)
    if rows.size != workers * n:
        raise ValueError(f"rows: {workers} rows of {n} elements are {workers * n}, got {rows.size}")
    out = _empty(n, np.int16)
    run(BF16_ROWS_SUM, n, [rows], [out], {"workers": workers, "n": n})
    return out


def widen_scaled_into(bits: np.ndarray, brain: bool, factor: float, out: np.ndarray) -> np.ndarray:
    """``out`` (contiguous float32, written in place) holding the 16-bit floats given as their bits
    (``bits``: int16 or uint16; bfloat16 where ``brain``, else IEEE half) widened and multiplied by
    ``factor`` in float32: the bits of a cast and then a product, in one pass."""
    if bits.size != out.size or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out: a contiguous float32 array of {bits.size} elements, got "
                         f"{out.dtype} of {out.size}{'' if out.flags.c_contiguous else ', strided'}")
    run(WIDEN_SCALED, bits.size, [np.ascontiguousarray(bits)], [out],
        {"brain": int(brain), "factor": factor})
    return out


def widen_scaled(bits: np.ndarray, brain: bool, factor: float) -> np.ndarray:
    """``widen_scaled_into`` a new float32 array."""
    return widen_scaled_into(bits, brain, factor, _empty(bits.size, np.float32)).reshape(bits.shape)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bits (int16) of float32 ``x``, rounded to nearest, ties to even (TensorFlow's
    cast, and torch's), every NaN as the quiet NaN 0x7fc0."""
    x = np.ascontiguousarray(x, np.float32)
    out = _empty(x.size, np.int16)
    run(BF16_ROUND, x.size, [x], [out])
    return out.reshape(x.shape)


def sums(x: np.ndarray) -> tuple[float, float, float]:
    """Float64 sum, float64 sum of squares, and the largest magnitude of float32 ``x``."""
    x = np.ascontiguousarray(x)
    partial = np.zeros((parts(x.size), 3))
    run(SUMS, x.size, [x], [partial])
    if len(partial) == 1:  # the common case of a small tensor, without the reductions below
        total, squares, top = partial[0].tolist()
        return total, squares, top
    tops = partial[:, 2]
    top = math.nan if np.isnan(tops).any() else float(tops.max())
    return float(partial[:, 0].sum()), float(partial[:, 1].sum()), top


def scaled_sum(*arrays: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """``a * alpha + b * beta`` in float32 for ``arrays`` = (a, b), or ``b * beta`` for (b,), shaped
    as ``b``."""
    b = arrays[-1]
    out = _empty(b.size, np.float32)
    run(SCALED_SUM, b.size, [arrays[0] if len(arrays) == 2 else None, b], [out],
        {"alpha": alpha, "beta": beta})
    return out.reshape(b.shape)


_BIN_INDEXES: dict = {}


def bin_index(boundaries: np.ndarray, key_bits: int = 16
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Ascending float32 boundaries (with +inf after them), and for each value of a float32's top
    ``key_bits`` bits the range [low, high] that holds the count of boundaries <= any float with
    those bits; and the shift that takes a float's bits to its key: what common.h's ``bin_of``
    reads. Built by a C sweep over the keys (about 0.35 ms for 16 bits, 0.1 ms for 14, whose ranges
    are wider); the last few are kept (u8bit's boundaries never change)."""
    shift = 32 - key_bits
    cache_key = (np.asarray(boundaries, np.float32).tobytes(), shift)
    if cache_key in _BIN_INDEXES:
        return _BIN_INDEXES[cache_key]
    # One slot past the end, so that reading boundaries[high] is always in bounds.
    table = np.append(np.asarray(boundaries, np.float32), np.float32(np.inf))
    low, high = np.empty(1 << key_bits, np.int32), np.empty(1 << key_bits, np.int32)
    once(BIN_INDEX, [table], [low, high], {"count": len(table) - 1, "shift": shift})
    if len(_BIN_INDEXES) >= 8:
        _BIN_INDEXES.pop(next(iter(_BIN_INDEXES)))
    _BIN_INDEXES[cache_key] = (table, low, high, shift)
    return table, low, high, shift


def indices_at_least(x: np.ndarray, threshold: float, dtype=np.int64) -> np.ndarray:
    """The indices (``dtype``: int32 or int64) of float32 ``x`` with ``|x| >= threshold``, in order."""
    params = {"threshold": threshold, "wide": int(np.dtype(dtype) == np.int64)}
    counts = np.array(run(COUNT_ABOVE, x.size, [x], [], params), np.int64)[:, None]
    offsets, (total,) = placement(counts)
    out = _empty(int(total), dtype)
    run(SELECT_ABOVE, x.size, [x], [out], params, offsets=offsets)
    return out


def topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` indices of float32 ``x`` of largest magnitude, ascending, in ``index_dtype``;
    where magnitudes tie at the k-th, the lowest indices (``Ops.topk_indices``)."""
    dtype = np.dtype(index_dtype(x.size))
    if k >= x.size or k <= 0:
        return np.arange(min(max(k, 0), x.size), dtype=dtype)
    out = _empty(k, dtype)
    if once(TOPK, [x], [out], {"n": x.size, "k": k, "wide": int(dtype == np.int64)}) != 0:
        raise MemoryError(f"grace.native.topk_indices: no memory for the candidates of {x.size} elements")
    return out


def choose_indices(n: int, k: int, seed: int) -> np.ndarray:
    """``grace.rng.reference_indices(n, k, seed)``: ``k`` distinct indices of ``[0, n)``, uniform,
    ascending, in ``index_dtype``."""
    dtype = np.dtype(index_dtype(n))
    out = _empty(k, dtype)
    complement = k > n - k  # draw the smaller of the set and what it leaves out
    status = once(CHOOSE, [], [out], {"n": n, "m": n - k if complement else k,
                                      "complement": int(complement), "wide": int(dtype == np.int64)}, seed)
    if status == -1:
        raise MemoryError(f"grace.native.choose_indices: no memory for a bitmap of {n} elements")
    if status == -2:
        raise ValueError(f"grace.native.choose_indices: n must be below 2**31, got {n}")
    return out


def count_at_least(x: np.ndarray, threshold: float) -> int:
    """How many elements of float32 ``x`` have ``|x| >= threshold``."""
    return sum(run(COUNT_ABOVE, x.size, [x], [], {"threshold": threshold}))


def scatter_add(n: int, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A float32 array of ``n`` zeros with ``values`` added at ``indices`` (int32 or int64)."""
    indices, values = np.ascontiguousarray(indices), np.ascontiguousarray(values, np.float32)
    if indices.size != values.size:
        raise ValueError(f"scatter_add: {indices.size} indices for {values.size} values")
    out = zeros(n, np.float32)
    bad = once(SCATTER_ADD, [indices, values], [out], {"n": n, "wide": int(indices.dtype == np.int64),
                                                       "k": values.size})
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


class Kernel(NamedTuple):
    """A loop as ``grace.kernels`` runs it in place of the composite step of the same name."""

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


def float32_at(*positions: int) -> Callable:
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
                         float32_at(0)),
    "unpack_blocks": Kernel(unpack_blocks, lambda packed, tables, bits, n, block: [("float32", (n,))],
                            _whole_codes),
    "unpack_blocks_onto": Kernel(unpack_blocks_onto,
                                 lambda packed, tables, base, bits, n, block: [("float32", (n,))],
                                 lambda dtypes, bits, **params: _whole_codes(dtypes, bits)
                                 and dtypes[2] == "float32"),
    "sign_bits": Kernel(sign_bits, lambda x: [("uint8", ((x[0] + 7) // 8,))], float32_at(0)),
    "unpack_values": Kernel(unpack_values, lambda packed, values, bits, n: [("float32", (n,))],
                            lambda dtypes, bits, **params: bits <= MAX_CODE_BITS
                            and dtypes[1] == "float32"),
    "scaled_sum": Kernel(scaled_sum, lambda *shapes, alpha, beta: [("float32", shapes[-1])],
                         lambda dtypes, **params: all(d == "float32" for d in dtypes)),
    "bf16_rows_sum": Kernel(bf16_rows_sum, lambda rows, workers, n: [("int16", (n,))]),
    "exact_top_k": Kernel(topk_indices, _top_k_outputs, float32_at(0)),
    # DGC's selection is the exact top-k too: its random sample only speeds the composite code up.
    "sampled_top_k": Kernel(lambda x, seed, k, m: topk_indices(x, k), _top_k_outputs, float32_at(0)),
}
"""The loops ``grace.kernels`` may run in place of the composite steps named alike: the protocol's
shared steps (``grace.steps``) here, and single algorithms' encoders and decoders, which each
compressor's module adds (``register``) beside its own C file."""


def register(name: str, kernel: Kernel) -> None:
    """Add a compressor's own loop to ``KERNELS`` (before the ``@accelerated(name)`` that names it)."""
    if name in KERNELS and KERNELS[name] != kernel:
        raise ValueError(f"grace.native: a kernel named {name!r} is registered already")
    KERNELS[name] = kernel


def run_kernel(kernel: str, arrays: list, seed: int | None = None, **params):
    """``KERNELS[kernel]`` on contiguous arrays (and ``params``, plain numbers), as a tuple of arrays."""
    loop = KERNELS[kernel].loop
    arrays = [np.ascontiguousarray(a) for a in arrays]
    result = loop(*arrays, seed, **params) if seed is not None else loop(*arrays, **params)
    return result if isinstance(result, tuple) else (result,)
