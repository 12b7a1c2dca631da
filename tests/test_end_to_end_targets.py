"""The end-to-end targets' table (docs/results.md), judged from hand-made compare.py rows whose
ratios are worked out here: a target met, missed everywhere, missed in part; each ratio against its
own file's one worker alone; a later file's row replacing an earlier one's; a missing row a miss."""

from __future__ import annotations

import json

from scripts import compare
from scripts.end_to_end_targets import AtLeast, OfAlone, markdown, rows_of, verdict


def run(fw: str, compression: str, rate: str, samples_per_s: float, workers: int = 2) -> dict:
    return {"workload": "resnet50", "framework": fw, "compression": compression, "rate": rate,
            "workers": workers, "status": "ok", "samples_per_s": samples_per_s, "step_s": 1.0,
            "compute_s": 0.5, "compression_s": 0.1, "communication_s": 0.4}


def alone(fw: str, samples_per_s: float) -> dict:
    return run(fw, "fp32", compare.ALONE, samples_per_s, workers=1)


def grace_spec(name: str) -> str:
    """A grace compression as compare.py records it (fp32 and hvd-fp16 are recorded by name)."""
    return json.dumps({"compressor": name})


TOPK = '{"compressor": "topk", "ratio": 0.01}'


def test_each_ratio_is_against_its_own_runs_one_worker_alone():
    # file 1: alone 50, top-k 2 workers at 90 img/s: 45 per worker, 0.90 of alone.
    # file 2: alone 40, fp16 2 workers at 60: 30 per worker, 0.75 of its own alone (0.60 of file 1's)
    first = [alone("torch", 50.0), run("torch", TOPK, "1gbit", 90.0)]
    second = [alone("torch", 40.0), run("torch", grace_spec("fp16"), "1gbit", 60.0)]
    rows, frameworks = rows_of([first, second])
    assert frameworks == ["torch"]
    assert rows[("torch", "1gbit", "topk(ratio=0.01)")].of_alone == 45.0 / 50.0
    assert rows[("torch", "1gbit", "fp16")].of_alone == 30.0 / 40.0
    assert rows[("torch", "1gbit", "fp16")].per_worker == 30.0


def test_a_later_files_row_replaces_an_earlier_ones():
    first = [alone("tf", 50.0), run("tf", TOPK, "1gbit", 80.0)]   # 0.80
    second = [alone("tf", 50.0), run("tf", TOPK, "1gbit", 92.0)]  # 0.92
    target = OfAlone("1gbit", ("topk(ratio=0.01)",), 0.90)
    assert "| no |" in markdown([first], [target])
    table = markdown([first, second], [target])
    assert "| TensorFlow 0.92 | yes |" in table
    assert "| TensorFlow 0.80 | no |" in markdown([second, first], [target])


def test_of_alone_met_missed_and_missed_in_part():
    runs = [alone("torch", 50.0), alone("tf", 50.0),
            run("torch", TOPK, "1gbit", 90.0), run("tf", TOPK, "1gbit", 89.0),  # 0.90, 0.89
            run("torch", grace_spec("dgc"), "1gbit", 95.0),  # 0.95
            run("tf", grace_spec("dgc"), "1gbit", 100.0)]  # 1.00
    target = OfAlone("1gbit", ("topk(ratio=0.01)", "dgc"), 0.90)
    measured, judged = target.judge(*rows_of([runs]))
    assert measured == "PyTorch 0.90, 0.95; TensorFlow 0.89, 1.00"
    assert judged == [("torch", "topk(ratio=0.01)", True), ("torch", "dgc", True),
                      ("tf", "topk(ratio=0.01)", False), ("tf", "dgc", True)]
    assert verdict(judged) == "no: TensorFlow topk(ratio=0.01)"
    assert verdict([(fw, c, True) for fw, c, _ in judged]) == "yes"
    assert verdict([(fw, c, False) for fw, c, _ in judged]) == "no"


def test_a_compression_not_run_misses_its_target():
    runs = [alone("torch", 50.0), run("torch", TOPK, "1gbit", 95.0)]
    measured, judged = OfAlone("1gbit", ("topk(ratio=0.01)", "dgc"), 0.90).judge(*rows_of([runs]))
    assert measured == "PyTorch 0.95, –"
    assert verdict(judged) == "no: PyTorch dgc"
    measured, judged = AtLeast("1gbit", ("none",), than="fp32").judge(*rows_of([runs]))
    assert measured == "PyTorch: no fp32 run beside them" and verdict(judged) == "no"
    assert verdict([]) == "no"  # nothing measured is not a target met
    measured, judged = AtLeast("100mbit", (), than="fp32").judge(*rows_of([runs]))
    assert verdict(judged) == "no"  # no run at that rate


def test_at_least_another_compression_with_and_without_slack():
    runs = [alone("torch", 50.0), run("torch", "fp32", "1gbit", 30.0),  # 15.0 per worker
            run("torch", grace_spec("none"), "1gbit", 29.2),  # 14.6: 2.7% below fp32
            run("torch", "hvd-fp16", "1gbit", 38.0), run("torch", grace_spec("fp16"), "1gbit", 37.8)]
    rows = rows_of([runs])
    measured, judged = AtLeast("1gbit", ("none",), than="fp32", slack=0.03).judge(*rows)
    assert measured == "PyTorch: none 14.6 against 15.0" and verdict(judged) == "yes"
    assert verdict(AtLeast("1gbit", ("none",), than="fp32", slack=0.02).judge(*rows)[1]) == "no"
    assert verdict(AtLeast("1gbit", ("fp16",), than="hvd-fp16").judge(*rows)[1]) == "no"
    assert AtLeast("1gbit", ("none",), than="fp32", slack=0.03).text() == "1gbit: none within 3% of fp32"


def test_every_compression_of_a_rate_but_the_baselines():
    runs = [alone("torch", 50.0), run("torch", "fp32", "unshaped", 70.0),
            run("torch", "hvd-fp16", "unshaped", 40.0), run("torch", TOPK, "unshaped", 80.0),
            run("torch", grace_spec("qsgd"), "unshaped", 69.0), run("torch", TOPK, "1gbit", 10.0)]
    target = AtLeast("unshaped", (), than="fp32", besides=("hvd-fp16",))
    measured, judged = target.judge(*rows_of([runs]))
    # hvd-fp16 (below fp32) is Horovod's own, not judged; the 1gbit row is another rate's
    assert measured == "PyTorch: topk(ratio=0.01) 40.0, qsgd 34.5 against 35.0"
    assert verdict(judged) == "no: PyTorch qsgd"
    assert target.text() == "unshaped: every compression at least fp32"


def test_a_comparison_is_within_one_run_and_failed_or_unanchored_rows_are_left_out():
    """``AtLeast`` sets a compression beside ``than`` of the same run, even where a later file
    replaced ``than``'s row; a failed repeat set-up and a file without one worker alone give no
    rows."""
    first = [alone("tf", 50.0), run("tf", "hvd-fp16", "1gbit", 38.0),  # 19.0 per worker
             run("tf", grace_spec("bf16"), "1gbit", 40.0)]  # 20.0: above its own run's 19.0
    second = [alone("tf", 50.0), run("tf", "hvd-fp16", "1gbit", 44.0)]  # 22.0, a run without bf16
    target = AtLeast("1gbit", ("bf16",), than="hvd-fp16")
    measured, judged = target.judge(*rows_of([first, second]))
    assert measured == "TensorFlow: bf16 20.0 against 19.0" and verdict(judged) == "yes"
    failed = dict(run("tf", grace_spec("bf16"), "1gbit", 90.0), status="failed: timeout")
    third = [alone("tf", 50.0), failed]
    unanchored = [run("tf", grace_spec("bf16"), "1gbit", 10.0)]  # no one worker alone in its file
    rows, _ = rows_of([first, third, unanchored])
    assert rows[("tf", "1gbit", "bf16")].per_worker == 20.0  # neither replaced the first's row


def test_a_run_with_ddp_and_the_exchange_gives_only_horovods_resnet50_rows():
    """A ``compare.py --engines horovod,ddp --workloads exchange,resnet50`` file: DDP's rows are not
    judged (its targets are docs/ddp.md's), nor the exchange's (another workload, whose rows
    would otherwise replace ResNet-50's of the same compression)."""
    runs = [alone("torch", 50.0), run("torch", grace_spec("fp16"), "1gbit", 60.0),  # 30 per worker
            run("torch", "hvd-fp16", "1gbit", 58.0),
            run("ddp", grace_spec("fp16"), "1gbit", 40.0), run("ddp", "hvd-fp16", "1gbit", 90.0),
            {**alone("torch", 900.0), "workload": "exchange"},
            {**run("torch", grace_spec("fp16"), "1gbit", 20.0), "workload": "exchange"}]
    rows, frameworks = rows_of([runs])
    assert frameworks == ["torch"]
    assert set(rows) == {("torch", "1gbit", "fp16"), ("torch", "1gbit", "hvd-fp16")}
    assert rows[("torch", "1gbit", "fp16")].of_alone == 30.0 / 50.0
    measured, judged = AtLeast("1gbit", ("fp16",), than="hvd-fp16").judge(rows, frameworks)
    assert measured == "PyTorch: fp16 30.0 against 29.0" and verdict(judged) == "yes"
