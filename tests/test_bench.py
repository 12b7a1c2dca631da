"""scripts/tools/bench_compressors.py reports what it measured: one row per framework and compressor, the
payload each compressor promises, a ratio that is the quotient of the times it printed, and a plot.
The times themselves are not checked (a shared machine); docs/performance.md gives them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import grace
from tests.launch import ROOT

SCRIPT = ["-m", "scripts.tools.bench_compressors"]  # run from the checkout (cwd=ROOT)
NUMEL = 300_001
COMPRESSORS = ["signsgd", "randomk", "qsgd", "topk"]

# The benchmark harness run for real (a bench of four compressors in both frameworks, sides through
# checkouts): half a minute, in `make test-slow` and CI as the checkout comparisons are (Makefile).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(
        [sys.executable, *SCRIPT, "--compressors", ",".join(COMPRESSORS), "--frameworks", "torch,tf",
         "--devices", "cpu", "--numel", str(NUMEL), "--model", "none", "--repeats", "3",
         "--warmup", "1", "--powersgd", "--json", str(out / "bench.json"), "--plot", str(out / "bench.png")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out / "bench.json") as f:
        return {"json": json.load(f), "stdout": run.stdout, "png": (out / "bench.png").read_bytes()}


def rows(report):
    return {(r["framework"], r["compressor"]): r for r in report["json"]["catalogue"]}


def test_a_row_per_framework_and_compressor(report):
    table = rows(report)
    assert sorted(table) == sorted((fw, c) for fw in ("torch", "tf") for c in COMPRESSORS)
    for row in table.values():
        assert "error" not in row, row
        assert row["device"] == "cpu" and row["tensors"] == 1


@pytest.mark.parametrize("name", COMPRESSORS)
def test_payload_is_what_the_compressor_promises(report, name):
    promised = grace.build(name).compressor.payload_nbytes((NUMEL,), 4)
    for fw in ("torch", "tf"):
        row = rows(report)[(fw, name)]
        assert row["payload_bytes"] == promised
        assert row["dense_bytes"] == 4 * NUMEL
        assert row["compression_ratio"] == pytest.approx(4 * NUMEL / promised)


def test_known_payload_sizes(report):
    table = rows(report)
    assert table[("torch", "signsgd")]["payload_bytes"] == math.ceil(NUMEL / 8)
    assert table[("torch", "randomk")]["payload_bytes"] == 4 * int(0.01 * NUMEL)  # above the floor


def test_ratio_is_the_quotient_of_the_reported_times(report):
    for row in rows(report).values():
        assert row["copy_s"] > 0 and row["compress_s"] > 0 and row["decompress_s"] >= 0
        expected = (row["compress_s"] + row["decompress_s"]) / row["copy_s"]
        assert row["ratio_to_copy"] == pytest.approx(expected, rel=1e-12)
        assert row["target"] == 2  # the tighter target covers all four compressors here


def test_powersgd_side_by_side(report):
    # Run after the catalogue, so in a process of its own (powersgd_in_fresh_process).
    result = {r["implementation"]: r for r in report["json"]["powersgd"]}
    grace_row, hook = result["grace.powersgd(rank=2)"], result["torch powerSGD_hook"]
    assert "error" not in hook and grace_row["relative_to_grace"] == 1.0
    assert hook["relative_to_grace"] == pytest.approx(hook["round_s"] / grace_row["round_s"], rel=1e-12)
    assert "| torch powerSGD_hook |" in report["stdout"]


def test_table_and_plot(report):
    assert "| framework | device | case | compressor |" in report["stdout"]
    assert "TensorFlow (tf.function) against PyTorch (eager)" in report["stdout"]
    assert report["png"][:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_compressor_is_refused_by_name():
    run = subprocess.run([sys.executable, *SCRIPT, "--compressors", "topk,nope"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2
    assert "--compressors: 'nope' is not one of" in run.stderr and "topk" in run.stderr


def _row(framework, compressor, compress_ms, decompress_ms, copy_ms, case="flat 10"):
    return {"framework": framework, "device": "cpu", "case": case, "compressor": compressor,
            "compress_s": compress_ms / 1e3, "decompress_s": decompress_ms / 1e3, "copy_s": copy_ms / 1e3}


def test_two_checkouts_are_benched_in_turn_and_tabled_after_over_before(monkeypatch, capsys):
    """``--before``: each side is a process of its own run ``--sides`` times in turn, given the
    catalogue's options; a row gives each side's median of compress + decompress, after / before
    (not before / after), the range of the paired runs' ratios and the copy's ratio; a compressor
    that failed on a side, or that one side lacks, gets no row. The sides' times are set here."""
    from scripts.tools import bench_compressors, checkout_sides

    before = [[_row("torch", "topk", 3, 1, 10), _row("tf", "qsgd", 5, 5, 10), _row("torch", "old", 1, 1, 1)],
              [_row("torch", "topk", 4, 2, 20), _row("tf", "qsgd", 6, 6, 10)],
              [_row("torch", "topk", 5, 3, 10), _row("tf", "qsgd", 4, 4, 10)]]
    after = [[_row("torch", "topk", 2, 0, 20), _row("tf", "qsgd", 10, 10, 10), _row("tf", "new", 1, 1, 1)],
             [_row("torch", "topk", 2, 1, 40), {**_row("tf", "qsgd", 1, 1, 1), "error": "ValueError: x"},
              _row("tf", "new", 1, 1, 1)],
             [_row("torch", "topk", 3, 3, 20), _row("tf", "qsgd", 8, 8, 10), _row("tf", "new", 1, 1, 1)]]
    calls = []

    def side(script, root, *args):
        calls.append((root, args))
        return (before if root == "/b" else after)[sum(r == root for r, _ in calls) - 1]

    monkeypatch.setattr(checkout_sides, "measure_side", side)
    monkeypatch.setattr(bench_compressors, "_commit", lambda root: root.strip("/"))
    report = bench_compressors.main(["--before", "/b", "--after", "/a", "--compressors", "topk,qsgd",
                                     "--frameworks", "torch,tf", "--model", "none", "--numel", "10",
                                     "--sides", "3"])
    assert [root for root, _ in calls] == ["/b", "/a"] * 3
    assert calls[0][1] == ("--compressors", "topk,qsgd", "--frameworks", "torch,tf", "--numel", "10",
                           "--model", "none", "--repeats", "9", "--warmup", "5")
    assert report["runs"] == {"before": before, "after": after} and report["before"] == "b"
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Before b, after a; medians of 3 runs a side, taken in turn (--compressors")
    table = [line for line in out if line.startswith("| ")]
    # topk: compress + decompress before 4, 6, 8 (median 6), after 2, 3, 6 (median 3); the paired
    # runs' ratios 2/4, 3/6, 6/8; the copy before 10, 20, 10 (median 10), after 20, 40, 20 (20).
    # qsgd: its second run after failed, so it has no row (a median of two runs is not the table's);
    # "old" and "new" were measured on one side only.
    assert table[1:] == ["| torch | flat 10 | topk | 6.0 | 3.0 | 0.500 | 0.50-0.75 | 2.00 |"]


def test_a_side_is_benched_through_the_checkout_it_names(tmp_path):
    """``--measure DIR`` (one side of ``--before``) imports the grace of the checkout it names,
    says so by refusing any other, and prints the catalogue's rows as its last line."""
    def measure(root):
        return subprocess.run([sys.executable, *SCRIPT, "--measure", root, "--compressors", "topk",
                               "--frameworks", "torch", "--model", "none", "--numel", "5000",
                               "--repeats", "1", "--warmup", "1"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    done = measure(ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert (row["framework"], row["compressor"], row["case"]) == ("torch", "topk", "flat 5,000")
    assert row["compress_s"] > 0 and row["payload_bytes"] == 50 * 8  # 1% of 5,000: values, indices
    wrong = measure(str(tmp_path))
    assert wrong.returncode != 0 and "grace was imported from" in wrong.stderr


def test_a_side_through_another_checkout_imports_that_checkouts_grace(tmp_path):
    """What ``--before`` runs: ``measure_side`` on another checkout (here one of links to this
    one's grace) gets that checkout's rows: the allocator's re-run of the script keeps the side's
    path (its checkout's grace first), or the side would import this one's and refuse to run."""
    from scripts.tools import bench_compressors
    from scripts.tools.checkout_sides import measure_side

    for part in ("grace", "frameworks", "grace-entry-points.cfg"):
        os.symlink(os.path.join(ROOT, part), tmp_path / part)
    rows = measure_side(bench_compressors.__file__, str(tmp_path), "--compressors", "topk",
                        "--frameworks", "torch", "--model", "none", "--numel", "5000",
                        "--repeats", "1", "--warmup", "1")
    assert [(r["compressor"], r["payload_bytes"]) for r in rows] == [("topk", 50 * 8)]


def test_one_case_cheapest_first_with_its_misses_marked():
    """``case_markdown`` (performance.md's ResNet-50 table): one case and framework only, sorted by
    (c + d) / copy, ✗ where that exceeds the compressor's target, errors left out."""
    from scripts.tools.bench_compressors import case_markdown

    def row(name, c, d, copy, target, case="resnet50", framework="torch"):
        return {"framework": framework, "case": case, "compressor": name, "compress_s": c,
                "decompress_s": d, "copy_s": copy, "ratio_to_copy": (c + d) / copy, "target": target}

    rows = [row("topk", 0.060, 0.030, 0.006, 2), row("fp16", 0.010, 0.005, 0.0075, 3),
            row("qsgd", 0.008, 0.004, 0.004, 3),  # exactly its target: met
            row("topk", 0.001, 0.001, 0.001, 2, case="flat"), row("fp16", 1.0, 1.0, 0.001, 3, framework="tf"),
            {"framework": "torch", "case": "resnet50", "compressor": "sketch", "error": "MemoryError"}]
    assert case_markdown(rows, "resnet50").splitlines()[2:] == [
        "| fp16 | 15.0 | 7.5 | 2.0 | ≤ 3 |", "| qsgd | 12.0 | 4.0 | 3.0 | ≤ 3 |",
        "| topk | 90.0 | 6.0 | 15.0 ✗ | ≤ 2 |"]
