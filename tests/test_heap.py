"""grace.heap: the framework wrappers keep freed memory in the process, so that each step's
full-size buffers reuse pages the last step touched instead of fresh ones (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import ROOT

# In a fresh interpreter (the thresholds are per process): allocate 16 MiB, below glibc's largest
# mmap threshold (32 MiB) and far above its default (128 KiB), and report where glibc put it
# (mallinfo2: hblkhd, the bytes in blocks mapped on their own; fordblks, the free bytes kept in the
# heap) while it lives and once it is freed.
PROBE = """
import ctypes, json, sys
import numpy as np
from grace import heap

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
applied = heap.keep_freed_memory()
before = libc.mallinfo2().hblkhd
block = np.ones(4 << 20, np.float32)
mapped = libc.mallinfo2().hblkhd - before
del block
print(json.dumps({{"applied": applied, "mapped": mapped, "kept": libc.mallinfo2().fordblks}}))
"""

BLOCK = 16 << 20


def _probe(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=ROOT)], capture_output=True,
                         text=True, env={**os.environ, **env}, check=True)
    return json.loads(out.stdout)


def test_a_step_sized_block_comes_from_the_heap_and_stays_there_once_freed():
    result = _probe({"GRACE_KEEP_FREED_MEMORY": "1"})
    assert result["applied"] is True
    assert result["mapped"] == 0  # not mapped afresh (and zero-filled by the kernel) on each use
    assert result["kept"] >= BLOCK  # freed, it stays for the next step


def test_without_it_glibc_maps_the_block_on_its_own_and_returns_it():
    result = _probe({"GRACE_KEEP_FREED_MEMORY": "0"})
    assert result["applied"] is False
    assert result["mapped"] >= BLOCK
    assert result["kept"] < BLOCK
