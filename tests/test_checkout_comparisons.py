"""scripts/pipeline_overhead.py and scripts/pipeline_digests.py compare two checkouts: each side is
measured through the checkout it names, and a digest is a function of what the code computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launch import ROOT

import grace


def measure(script: str, root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), "--measure", root,
                           *args], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                          cwd=ROOT)


def test_a_side_is_timed_through_the_checkout_it_names(tmp_path):
    """The grace a side imports is the named checkout's (the script asserts it), and every
    compression gets a positive time; a checkout that is not grace's is refused."""
    done = measure("pipeline_overhead.py", ROOT, "--compressors", "topk,none", "--steps", "1")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(figures) == {"topk", "none"} and all(ms > 0 for ms in figures.values())
    wrong = measure("pipeline_overhead.py", str(tmp_path), "--compressors", "none", "--steps", "1")
    assert wrong.returncode != 0 and "AssertionError" in wrong.stderr


def test_digests_are_the_same_run_after_run_and_differ_between_compressors():
    """Two runs of the same code give the same digest for every compressor and set-up (else a
    comparison of checkouts would find differences that are not there), distinct compressors give
    distinct ones, and the set-ups a compressor refuses are the ones its construction rejects."""
    first, second = (json.loads(measure("pipeline_digests.py", ROOT).stdout.strip().splitlines()[-1])
                     for _ in range(2))
    assert first == second
    assert len(first) == 8 * len(grace.available())
    computed = [v for v in first.values() if not v.startswith("refused")]
    assert len(set(computed)) == len(computed)
    assert sorted(k for k, v in first.items() if v.startswith("refused")) == [
        "alltoall fp16", "alltoall none", "alltoall powersgd", "alltoall randomk", "bucket powersgd"]
