"""scripts/cost_model.py: the α-β model's byte counts are those of the schedules it names, its
step times follow from them, and a measured run is set against its prediction."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cost_model  # noqa: E402

MB = 1e6
RATE = cost_model.RATES["1gbit"]


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64, 1024])
def test_bytes_per_worker_follow_the_schedules(n):
    """Ring allreduce: 2(n-1)/n of the payload; ring allgather: n-1 payloads; all-to-all +
    all-gather: 2(n-1)/n. So allreduce and all-to-all stay below twice the payload at any n,
    and allgather grows linearly."""
    _, reduced = cost_model.collective("allreduce", n, MB, RATE)
    _, gathered = cost_model.collective("allgather", n, MB, RATE)
    _, two_stage = cost_model.collective("alltoall", n, MB, RATE)
    assert reduced == pytest.approx(2 * (n - 1) / n * MB)
    assert gathered == pytest.approx((n - 1) * MB)
    assert two_stage == pytest.approx(2 * (n - 1) / n * MB)
    assert two_stage < 2 * MB


def test_time_is_latency_plus_bytes_over_the_rate():
    seconds, sent = cost_model.collective("allgather", 4, 10 * MB, RATE, alpha=1e-3, hop=1e-4)
    assert seconds == pytest.approx(1e-3 + 3 * 1e-4 + 30 * MB / RATE)
    assert cost_model.collective("allreduce", 1, MB, RATE) == (0.0, 0.0)
    with pytest.raises(ValueError, match="kind must be one of allreduce, allgather, alltoall"):
        cost_model.collective("ring", 2, MB, RATE)


def test_decoding_follows_the_route():
    """After an allgather a worker decodes every worker's payload; after an allreduce one."""
    codec = cost_model.Codec("x", 1 * MB, encode_s=0.01, decode_s=0.002, communicator="allgather")
    gathered = cost_model.step(codec, "allgather", 8, RATE, 0.05, collectives=2)
    reduced = cost_model.step(codec, "allreduce", 8, RATE, 0.05, collectives=2)
    assert gathered["coding_s"] == pytest.approx(0.01 + 8 * 0.002)
    assert reduced["coding_s"] == pytest.approx(0.012)
    assert gathered["step_s"] == pytest.approx(0.05 + gathered["coding_s"] + gathered["exchange_s"])
    assert gathered["link_bytes"] == pytest.approx(2 * 7 * MB)


def test_a_measured_run_is_set_against_its_prediction(tmp_path):
    run = {"status": "ok", "workload": "exchange", "rate": "1gbit", "workers": 2,
           "compression": "fp32", "bytes_per_step": 100 * MB, "step_s": 1.0, "compute_s": 0.05,
           "compression_s": 0.0, "wire_bytes_per_step": 201 * MB}
    path = tmp_path / "results.json"
    path.write_text(json.dumps([run]))
    codecs = {"fp32": cost_model.Codec("fp32", 100 * MB, 0.0, 0.0, "allreduce")}
    (row,) = cost_model.validate([str(path)], codecs)
    buckets = cost_model.collectives_per_round("fp32")
    exchange = buckets * cost_model.collective("allreduce", 2, 100 * MB / buckets, RATE)[0]
    assert row["predicted_step_ms"] == pytest.approx(1e3 * (0.05 + exchange))
    assert row["predicted_link_bytes"] == pytest.approx(200 * MB + cost_model.CONTROL_BYTES_PER_S)
    assert row["bytes_error"] == pytest.approx((200 * MB + 0.6 * MB) / (201 * MB) - 1)
