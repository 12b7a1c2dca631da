"""scripts/tools/pipeline_overhead.py and scripts/tools/pipeline_digests.py compare two checkouts:
each side is measured through the checkout it names, and a digest is a function of what the code
computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import grace
from tests.launch import ROOT

# Minutes long: in `make test-slow` and CI, not in `make test` (Makefile).
pytestmark = pytest.mark.slow


def measure(script: str, root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "tools", script), "--measure", root,
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


def test_a_digest_follows_the_results_and_the_state_values(monkeypatch):
    """The digest changes when a result or a state tensor changes by one value and nothing else
    does (its shape, the repr, the stats): a digest of the structure alone would miss the change
    a restructuring must not make."""
    from grace.pipeline import Pipeline
    from scripts.tools import pipeline_digests

    same = pipeline_digests.digest("topk", "sgd")
    assert pipeline_digests.digest("topk", "sgd") == same
    finish, state = Pipeline.finish_step, Pipeline.state_dict

    def nudged_result(self, *args, **kwargs):
        out = finish(self, *args, **kwargs)
        flat = out[0][0].view(-1)
        flat[flat.numel() // 2] += 1e-6  # one element in the middle of one result
        return out

    def nudged_state(self):
        saved = state(self)
        residual = saved["memory"]["residuals"]["t0"].view(-1)  # a copy
        residual[residual.numel() // 2] += 1e-6  # one element in the middle, where repr shows none
        return saved

    monkeypatch.setattr(Pipeline, "finish_step", nudged_result)
    assert pipeline_digests.digest("topk", "sgd") != same
    monkeypatch.setattr(Pipeline, "finish_step", finish)
    monkeypatch.setattr(Pipeline, "state_dict", nudged_state)
    assert pipeline_digests.digest("topk", "sgd") != same


def test_two_checkouts_that_differ_in_one_compressor_are_told_apart(tmp_path):
    """``--before/--after``: a copy of this checkout whose top-k encodes its input scaled by
    1.0001 differs from it in top-k's eight set-ups and in nothing else, and the script exits 1;
    the same checkout on both sides differs nowhere and exits 0; a folder that is not a grace
    checkout is refused."""
    import shutil

    copy = tmp_path / "mutant"
    for part in ("grace", "frameworks"):
        shutil.copytree(os.path.join(ROOT, part), copy / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "grace-entry-points.cfg"), copy)
    with open(copy / "grace" / "compressors" / "topk.py", "a") as f:
        f.write("\n\n_exact = TopK.compress_flat\n\n\ndef _scaled(self, flat, name, ctx, ops):\n"
                "    return _exact(self, flat * 1.0001, name, ctx, ops)\n\n\nTopK.compress_flat = _scaled\n")

    def compare(before: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "scripts.tools.pipeline_digests", "--before", before,
                               "--after", ROOT, "--compressors", "topk,none"],
                              capture_output=True, text=True, cwd=ROOT)

    mutant = compare(str(copy))
    assert mutant.returncode == 1, mutant.stderr
    lines = mutant.stdout.strip().splitlines()
    assert lines[0] == "16 compressor and set-up pairs (1 refused alike), 8 differ"
    assert sorted(line.split(":")[0].strip() for line in lines[1:]) == sorted(
        f"{setup} topk" for setup in ("plain", "sgd", "adam", "warmup", "bucket", "alltoall",
                                      "hierarchical", "sparse"))
    same = compare(ROOT)
    assert same.returncode == 0 and same.stdout.strip() == \
        "16 compressor and set-up pairs (1 refused alike), 0 differ"
    wrong = measure("pipeline_digests.py", str(tmp_path), "--compressors", "none")
    assert wrong.returncode != 0 and "AssertionError" in wrong.stderr


def test_the_timing_table_gives_each_sides_median_and_after_over_before(monkeypatch, capsys):
    """``--before/--after``: the sides are measured in turn, ``--repeats`` times, and each
    compression's row gives both sides' medians, after / before (not before / after) and the range
    of the repeats' ratios. The sides' times are set here (no timing in a test)."""
    from scripts.tools import checkout_sides, pipeline_overhead

    times = {"before": iter([{"none": 10.0, "topk": 40.0}, {"none": 12.0, "topk": 44.0},
                             {"none": 11.0, "topk": 60.0}]),
             "after": iter([{"none": 15.0, "topk": 20.0}, {"none": 18.0, "topk": 22.0},
                            {"none": 16.5, "topk": 30.0}])}
    order = []

    def side(script, root, *args):
        order.append(root)
        return next(times["before" if root == "/b" else "after"])

    monkeypatch.setattr(checkout_sides, "measure_side", side)
    pipeline_overhead.main(["--before", "/b", "--after", "/a", "--compressors", "none,topk",
                            "--repeats", "3"])
    assert order == ["/b", "/a"] * 3  # interleaved
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| none | 11.0 | 16.5 | 1.500 | 1.50-1.50 |",
                        "| topk | 44.0 | 22.0 | 0.500 | 0.50-0.50 |"]
