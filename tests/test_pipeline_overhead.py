"""scripts/pipeline_overhead.py: each side is measured through the checkout it names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launch import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "pipeline_overhead.py")


def test_a_side_is_measured_through_the_checkout_it_names(tmp_path):
    """The grace a side imports is the named checkout's (the script asserts it), and every
    compression gets a positive time; a checkout that is not grace's is refused."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, SCRIPT, "--measure", ROOT, "--compressors", "topk,none",
                          "--steps", "1"], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(figures) == {"topk", "none"} and all(ms > 0 for ms in figures.values())
    wrong = subprocess.run([sys.executable, SCRIPT, "--measure", str(tmp_path), "--compressors", "none",
                            "--steps", "1"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert wrong.returncode != 0 and "AssertionError" in wrong.stderr
