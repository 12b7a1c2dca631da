"""scripts/tools/bench_compressors.py reports what it measured: one row per framework and compressor, the
payload each compressor promises, a ratio that is the quotient of the times it printed, and a plot.
The times themselves are not checked (a shared machine); docs/performance.md gives them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import grace
from tests.launch import ROOT

SCRIPT = ["-m", "scripts.tools.bench_compressors"]  # run from the checkout (cwd=ROOT)
NUMEL = 300_001
COMPRESSORS = ["signsgd", "randomk", "qsgd", "topk"]


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
