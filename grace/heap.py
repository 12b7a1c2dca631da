"""Keep freed memory in the process for the next step instead of handing it back to the kernel.

Every step of a compressed exchange allocates full-size, short-lived buffers: the compensated
gradient, a decoded payload, the dense result a sparse one is scattered into. glibc serves
allocations from 128 KiB up (its threshold moves with what is freed, up to 32 MiB) with fresh
pages from ``mmap`` and trims free memory above 2× that threshold off the heap's top. So each step
maps its buffers anew and the kernel zero-fills every page on first touch: on ResNet-50's 25.6 M
gradients, scattering top-k's entries into zeros took 50 ms a step, 6 ms with the memory kept
(``docs/performance.md``, "Memory the steps reuse"), about a quarter of top-k's step on one core.

``keep_freed_memory`` fixes glibc's thresholds with ``mallopt``: blocks up to 32 MiB (glibc's
largest ``M_MMAP_THRESHOLD``) come from the heap, and up to 1 GiB of free heap stays mapped
(``M_TRIM_THRESHOLD``), so the next step reuses pages already touched. It is what PyTorch's CUDA
caching allocator does for device memory, and what ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` do from the environment. The cost: memory freed by a step stays in the
process (at most the largest step's transient buffers, plus fragmentation) rather than being
returned at once. The framework wrappers call it when they are built; ``GRACE_KEEP_FREED_MEMORY=0``
leaves glibc as it is. Elsewhere than glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 32 << 20
"""Blocks below this size come from the heap: glibc's upper bound for ``M_MMAP_THRESHOLD`` on
64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``); larger ones are still mapped on their own."""

TRIM_THRESHOLD = 1 << 30
"""Free memory at the heap's top up to this size stays mapped."""

ENV = "GRACE_KEEP_FREED_MEMORY"

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's heap thresholds once per process (see the module's docstring). True when they
    are set, False where they cannot be (not glibc) or ``GRACE_KEEP_FREED_MEMORY=0``."""
    global _applied
    if _applied is None:
        _applied = os.environ.get(ENV, "1") != "0" and _set_thresholds()
    return _applied


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: another libc's mallopt takes other numbers
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Setting either threshold also stops glibc from moving them, so both are set.
    mapped = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and mapped
