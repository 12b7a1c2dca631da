"""scripts/tools/cost_model.py: the α-β model's byte counts are those of the schedules it names, its
step times follow from them, and a measured run is set against its prediction."""

from __future__ import annotations

import json
import os

import pytest

from scripts.tools import cost_model
from tests.launch import ROOT

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


@pytest.mark.parametrize("n", [2, 4, 64])
def test_owners_that_keep_more_move_more_and_stay_flat(n):
    """Through the owners with a share ``s`` (top-k's owners keep twice the workers' share):
    ``(1 + s)(n-1)/n`` of the payload, still below ``1 + s`` payloads at any n."""
    _, two_stage = cost_model.collective("alltoall", n, MB, RATE, owner_share=2.0)
    assert two_stage == pytest.approx(3 * (n - 1) / n * MB)
    assert two_stage < 3 * MB


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


def validated(tmp_path, codec, **run):
    """The model's row for one measured exchange run (a step of 1 s, 50 ms of compute)."""
    run = {"status": "ok", "workload": "exchange", "step_s": 1.0, "compute_s": 0.05, **run}
    path = tmp_path / "results.json"
    path.write_text(json.dumps([run]))
    (row,) = cost_model.validate([str(path)], {codec.name: codec})
    return row


def test_a_measured_run_is_set_against_its_prediction(tmp_path):
    row = validated(tmp_path, cost_model.Codec("fp32", 100 * MB, 0.0, 0.0, "allreduce"),
                    rate="1gbit", workers=2, compression="fp32", bytes_per_step=100 * MB,
                    compression_s=0.0, wire_bytes_per_step=201 * MB)
    # Worked by hand: ResNet-50's gradients (97.5 MiB) take 5 buckets of 25 MiB; each allreduce of
    # 20 MB between 2 workers costs the 1 ms cycle, 2 hops of 50 us, and 2 (n-1)/n x 20 MB at
    # 1.25e8 B/s (0.16 s): 5 x 0.1611 = 0.8055 s, on top of 50 ms of compute.
    assert cost_model.collectives_per_round("fp32") == 5
    assert row["predicted_step_ms"] == pytest.approx(855.5)
    assert row["predicted_link_bytes"] == pytest.approx(200 * MB + cost_model.CONTROL_BYTES_PER_S)
    assert row["bytes_error"] == pytest.approx((200 * MB + 0.6 * MB) / (201 * MB) - 1)


def test_the_route_a_run_took():
    """A run's route: as it reported, else as its spec names it (``auto`` by the job's size), else
    the compressor's default (``auto`` for a gathered one)."""
    gathered = cost_model.Codec("topk", MB, 0.0, 0.0, "allgather")
    summed = cost_model.Codec("randomk", MB, 0.0, 0.0, "allreduce")
    spec = json.dumps({"compressor": "topk"})
    assert cost_model.route(spec, gathered, 4) == "allgather"
    assert cost_model.route(spec, gathered, 8) == "alltoall"
    assert cost_model.route(spec, gathered, 8, used="allgather") == "allgather"
    assert cost_model.route(json.dumps({"compressor": "topk", "communicator": "alltoall"}),
                            gathered, 2) == "alltoall"
    assert cost_model.route(json.dumps({"compressor": "randomk"}), summed, 8) == "allreduce"


def test_an_unshaped_run_checks_the_bytes_only(tmp_path):
    """Through the owners at 4 hosts: each worker sends and receives 2 (3/4) of its payload."""
    row = validated(tmp_path, cost_model.Codec("topk", 2 * MB, 0.0, 0.0, "allgather"),
                    rate="unshaped", workers=4, communicator="alltoall",
                    compression=json.dumps({"compressor": "topk", "communicator": "alltoall"}),
                    bytes_per_step=2 * MB, compression_s=0.1, wire_bytes_per_step=6.5 * MB)
    assert "step_error" not in row and row["communicator"] == "alltoall"
    sent = 2 * 3 / 4 * (2 * MB)
    assert row["predicted_link_bytes"] == pytest.approx(2 * sent + cost_model.CONTROL_BYTES_PER_S)


def test_a_run_through_owners_that_keep_more_is_modelled_with_its_share(tmp_path):
    """A run that recorded its owners' share ``s``: a worker handed Horovod ``(n-1)/n`` of its
    payload ``P`` and its own re-encoded shard, ``s/n`` of one (``bytes_per_step``), and moves
    ``(1 + s)(n-1)/n`` of ``P`` each way. A run that recorded none ran with ``s = 1``."""
    codec = cost_model.Codec("topk", 2 * MB, 0.0, 0.0, "allgather")
    payload = 2 * MB
    common = dict(rate="unshaped", workers=4, communicator="alltoall", compression_s=0.1,
                  compression=json.dumps({"compressor": "topk", "communicator": "alltoall"}),
                  wire_bytes_per_step=6.5 * MB)
    row = validated(tmp_path, codec, **common, owner_share=2.0,
                    bytes_per_step=(3 / 4 + 2 / 4) * payload)
    sent = 3 * 3 / 4 * payload
    assert row["predicted_link_bytes"] == pytest.approx(2 * sent + cost_model.CONTROL_BYTES_PER_S)
    assert row["owner_share"] == 2.0  # the bytes plot draws each share as its own line
    row = validated(tmp_path, codec, **common, bytes_per_step=payload)
    assert row["predicted_link_bytes"] == pytest.approx(2 * 2 * 3 / 4 * payload
                                                        + cost_model.CONTROL_BYTES_PER_S)
    assert row["owner_share"] == 1.0


def test_an_unshaped_run_gives_the_host_overhead_of_its_timed_twin(tmp_path):
    """The exchange's cost beyond the link, read off the unshaped run of the same set-up in the
    same file (its measured exchange less the model's link time at the unshaped rate), is added
    to the timed run's prediction; a run of another file is not paired."""
    codec = cost_model.Codec("topk", 2 * MB, 0.0, 0.0, "allgather")
    common = {"status": "ok", "workload": "exchange", "framework": "torch", "workers": 2,
              "compression": json.dumps({"compressor": "topk"}), "bytes_per_step": 2 * MB,
              "compute_s": 0.05, "compression_s": 0.1}
    unshaped = {**common, "rate": "unshaped", "step_s": 0.25}
    timed = {**common, "rate": "1gbit", "step_s": 0.30}
    path = tmp_path / "same.json"
    path.write_text(json.dumps([unshaped, timed]))
    rows = cost_model.validate([str(path)], {"topk": codec})
    row = next(r for r in rows if r["rate"] == "1gbit")
    # Worked by hand: top-k's 6 buckets (its dense small tensors travel apart), each an allgather
    # of 2/6 MB between 2 workers over the unshaped link (8.25e8 B/s): 1 ms + 50 us + 0.404 ms,
    # 8.724 ms in all; the host's share is what the unshaped step leaves of its 250 ms after
    # 50 ms of compute, 100 ms of compression and that: 91.276 ms.
    assert cost_model.collectives_per_round("topk") == 6
    assert row["host_overhead_ms"] == pytest.approx(91.2758, abs=1e-3)
    assert row["predicted_with_host_ms"] == pytest.approx(row["predicted_step_ms"] + 91.2758, abs=1e-3)
    assert row["step_error_with_host"] == pytest.approx(row["predicted_with_host_ms"] / 300 - 1)
    other = tmp_path / "other.json"
    other.write_text(json.dumps([timed]))
    rows = cost_model.validate([str(path), str(other)], {"topk": codec})
    (from_other,) = [r for r in rows if r["source"].endswith("other.json")]
    assert "host_overhead_ms" not in from_other
    # Another setting of the same compressor and route is another set-up: not paired either.
    setting = {**timed, "compression": json.dumps({"compressor": "topk", "owner_ratio": 0.02})}
    path.write_text(json.dumps([unshaped, setting]))
    (row,) = [r for r in cost_model.validate([str(path)], {"topk": codec}) if r["rate"] == "1gbit"]
    assert "host_overhead_ms" not in row


# --- the documented validation, against the recorded runs it cites ------------------------------
RESULTS_MD = os.path.join(ROOT, "docs", "results.md")


def _documented_validation() -> tuple[str, list[str]]:
    """docs/results.md's text and the run files its cost-model command validates against."""
    with open(RESULTS_MD, encoding="utf-8") as f:
        text = f.read()
    start = text.index("-m scripts.tools.cost_model --out data/results/model")
    command = []
    for line in text[start:].splitlines():
        command.append(line)
        if not line.rstrip().endswith("\\"):
            break
    files = [word for word in " ".join(command).split() if word.endswith(".json")]
    return text, files


def _pct(x: float, digits: int = 0) -> str:
    """A signed percentage as the docs write it (a true minus sign)."""
    return f"{100 * x:+.{digits}f}%".replace("-", "−")


def _within(rows: list[dict], limit: float = 0.25) -> tuple[int, int]:
    timed = [r for r in rows if "step_error_with_host" in r]
    return sum(abs(r["step_error_with_host"]) <= limit for r in timed), len(timed)


@pytest.fixture(scope="module")
def documented(tmp_path_factory):
    text, files = _documented_validation()
    out = tmp_path_factory.mktemp("model")
    cost_model.main(["--out", str(out), "--validate", *[os.path.join(ROOT, f) for f in files]])
    with open(out / "model.json") as f:
        rows = json.load(f)["validated"]
    return text, files, out, rows


def test_the_model_page_is_what_its_command_gives_on_the_recorded_runs(documented):
    """data/results/model/model.md is regenerated by the command docs/results.md gives, from the run
    files it names and make bench's recorded codecs: a change to the model, the runs or the page
    that the other two do not follow fails here."""
    _, files, out, rows = documented
    assert len(files) == 6 and all(os.path.exists(os.path.join(ROOT, f)) for f in files)
    with open(os.path.join(ROOT, "data", "results", "model", "model.md"), encoding="utf-8") as f:
        committed = f.read()
    assert (out / "model.md").read_text(encoding="utf-8") == committed
    assert {r["source"] for r in rows} == set(files)


def test_the_documented_figures_come_from_the_validation(documented):
    """The figures docs/results.md states of the model against the emulated cluster, recomputed
    from the recorded runs: the one-pass table's PyTorch rows and TensorFlow's ranges, the table of
    the two runs with the wait asleep (every cell), the counts within 25% and the bytes' bounds.
    (The sentences on single runs' errors are read off the same rows, but not checked here.)"""
    text, _, _, rows = documented

    def of(source, rate="1gbit"):
        return [r for r in rows if r["source"].endswith(source) and r["rate"] == rate]

    torch_rows = {r["compressor"]: r for r in of("onepass/exchange-torch.json")}
    table = text[text.index("**Against the emulated cluster**"):text.index("- **Bytes are right**")]
    # the tables are generated from these runs (tests/test_doc_tables.py holds them to their data)
    assert ("<!-- generated: cost_model.link data/results/onepass/exchange-torch.json "
            "data/results/onepass/exchange-tf.json -->") in table
    assert max(abs(r["bytes_error"]) for r in torch_rows.values()) <= 0.015  # "within 1.5%"
    tf_rows = of("onepass/exchange-tf.json")
    dgc_tf = next(r for r in tf_rows if r["compressor"] == "dgc")
    assert max(abs(r["bytes_error"]) for r in tf_rows) == dgc_tf["bytes_error"]
    assert "(DGC on TensorFlow " + _pct(dgc_tf["bytes_error"], 1).replace("−", "-") + ")" in text
    steps = {r["compressor"]: r["step_error"] for r in torch_rows.values()}
    assert f"fp32 within {-100 * steps['fp32']:.0f}%" in text
    assert f"top-k within {-100 * steps['topk']:.0f}%" in text

    # At 2 workers, with the host's share: the one-pass runs and the spinning run's 2-worker rows.
    spinning_run = os.path.join(ROOT, "data", "results", "model", "exchange-host-overhead-spinning.json")
    spinning = cost_model.validate([spinning_run], cost_model.codecs())
    two = [r for r in rows if "onepass/" in r["source"]] + [r for r in spinning if r["workers"] == 2]
    within, timed = _within(two)
    assert f"At 2 workers {within} of {timed} runs are then within" in " ".join(text.split())

    # The two runs with the wait asleep, then the runs with owners keeping 2k and 1-bit's passes.
    asleep = [r for r in rows if "exchange-host-overhead" in r["source"]]
    within, timed = _within(asleep)
    four = _within([r for r in asleep if r["workers"] == 4])
    assert f"{within} of {timed} within 25%, {four[0]} of {four[1]} at 4 workers" in text

    assert ("<!-- generated: cost_model.host data/results/model/exchange-host-overhead.json "
            "data/results/model/exchange-host-overhead-repeat.json -->") in text
    passes = [r for r in rows if r["source"].endswith("exchange-onebit-2passes.json")]
    within, timed = _within(passes)
    four = _within([r for r in passes if r["workers"] == 4])
    worst = max(abs(r["bytes_error"]) for r in passes if r["rate"] != "unshaped")
    assert (f"bytes within {100 * worst:.1f}%: {within} of {timed} within 25%, "
            f"{four[0]} of {four[1]} at 4 workers") in text
    owners = [r for r in rows if r["source"].endswith("exchange-owners-2k.json")]
    worst = max(abs(r["bytes_error"]) for r in owners if r["rate"] != "unshaped")
    assert f"bytes within {100 * worst:.1f}%" in text


def test_the_validation_tables_set_each_figure_in_its_cell():
    """``link_and_step_table`` and ``host_error_table`` (docs/results.md's generated tables) from
    hand-made validation rows: each error under its compressor, route, workers and run file, the
    unshaped rows left out, a set-up missing from one run shown as such, the count within 25%."""
    def row(source, name, route, workers, error, rate="1gbit"):
        out = {"source": source, "framework": "torch", "compressor": name, "communicator": route,
               "rate": rate, "workers": workers, "measured_step_ms": 200.0}
        if rate != "unshaped":
            out.update(predicted_step_ms=150.0, step_error=-0.25, predicted_with_host_ms=0.0,
                       host_overhead_ms=0.0, step_error_with_host=error,
                       measured_link_bytes=4e6, predicted_link_bytes=4.1e6, bytes_error=0.025)
        return out

    # run files given b then a: the columns follow the order given, not the names
    rows = [row("b.json", "fp32", "allreduce", 2, 0.03), row("b.json", "topk", "alltoall", 2, 0.30),
            row("b.json", "topk", "alltoall", 4, -0.10),
            row("b.json", "topk", "alltoall", 4, 9.0, "unshaped"),
            row("a.json", "fp32", "allreduce", 2, -0.04), row("a.json", "topk", "alltoall", 2, 0.25),
            row("a.json", "fp32", "allreduce", 4, 0.26), row("a.json", "topk", "allgather", 2, -0.5)]
    assert cost_model.host_error_table(rows).splitlines() == [
        "| + host overhead, error of the prediction | 2 workers: run 1 / run 2 | 4 workers: run 1 / run 2 |",
        "|---|---:|---:|",
        "| fp32 | +3% / -4% | – / +26% |",
        "| topk through the owners | +30% / +25% | -10% / – |",
        "| topk gathered | – / -50% | – / – |",
        "| within 25% | 3 of 5 | 1 of 2 |"]  # exactly 25% is within
    other_rate = dict(row("a.json", "fp32", "allreduce", 2, 0.5), rate="100mbit")
    table = cost_model.host_error_table(rows[:1] + [other_rate])
    assert "| fp32 at 1gbit | +3% / – |" in table and "| fp32 at 100mbit | – / +50% |" in table
    link = cost_model.link_and_step_table(rows[:1] + rows[3:4] + rows[-1:])
    assert link.splitlines()[2:] == [
        "| PyTorch fp32, 2 workers at 1gbit | 4.00 → 4.10 MB (+2.5%) | 200 → 150 ms (-25%) |",
        "| PyTorch topk gathered, 2 workers at 1gbit | 4.00 → 4.10 MB (+2.5%) | 200 → 150 ms (-25%) |"]
