"""compare.py's tables of several run files (``compare.bytes``, ``compare.runs`` in
``scripts/doc_tables.py``), worked by hand: bytes against the number of workers with a growth
ratio, and several runs' ratios to their own fp32 side by side."""

from scripts import compare

TOPK = '{"compressor": "topk"}'
OWNERS = '{"compressor": "topk", "communicator": "alltoall"}'
QSGD = '{"compressor": "qsgd"}'
DGC = '{"compressor": "dgc"}'


def run(compression, workers, step_s, wire=None, framework="torch", rate="unshaped", repeat=0,
        status="ok"):
    row = {"workload": "exchange", "framework": framework, "compression": compression, "rate": rate,
           "workers": workers, "status": status, "samples_per_s": 32 / step_s, "step_s": step_s,
           "compute_s": 0.0, "compression_s": 0.0, "communication_s": step_s, "repeat": repeat}
    return row if wire is None else {**row, "wire_bytes_per_step": wire}


def test_bytes_per_worker_count_with_their_growth_and_a_later_files_version_named_by_its_file():
    older = [run("fp32", 2, 1.0, 2048 * 1024), run("fp32", 8, 2.0, 3584 * 1024),
             run(OWNERS, 2, 0.5, 100 * 1024), run(OWNERS, 8, 0.5, 150 * 1024),
             run(QSGD, 2, 0.5, 10 * 1024), run(QSGD, 8, 0.5, 70 * 1024, status="failed")]
    newer = [run(OWNERS, 2, 0.5, 200 * 1024), run(OWNERS, 8, 0.5, 320 * 1024)]
    table = compare.bytes_markdown([("data/a/old.json", older), ("data/a/new.json", newer)])
    assert table.splitlines() == [
        "exchange, PyTorch, unshaped: KiB on one worker's link per step, by the number of workers.",
        "",
        "| compression | 2 workers | 8 workers | 8 / 2 |",
        "|---|---:|---:|---:|",
        "| fp32 | 2,048 | 3,584 | 1.75 |",  # 3584 / 2048
        # the same compression in two files: each named by its file
        "| topk(communicator=alltoall) (old) | 100 | 150 | 1.50 |",
        "| qsgd | 10 |  |  |",  # a failed run shows nothing, and no growth without both ends
        "| topk(communicator=alltoall) (new) | 200 | 320 | 1.60 |",
    ]


def test_bytes_take_the_median_repeat():
    repeats = [run("fp32", 2, s, wire, repeat=i) for i, (s, wire) in
               enumerate([(1.0, 1024 * 10), (2.0, 1024 * 30), (3.0, 1024 * 20)])]
    # The median by samples/s is the 2.0 s repeat (16 of 32, 16, 10.7 samples/s): its bytes.
    assert "| fp32 | 30 |  |" in compare.bytes_markdown([("r.json", repeats)])


def test_runs_side_by_side_each_against_its_own_fp32():
    first = [run("fp32", 2, 0.9, rate="1gbit"), run(TOPK, 2, 0.15, rate="1gbit"),
             run(DGC, 2, 0.3, rate="1gbit")]
    second = [run("fp32", 2, 1.2, rate="1gbit", framework="tf"), run(TOPK, 2, 0.4, rate="1gbit",
                                                                      framework="tf")]
    table = compare.runs_markdown([("x/run1.json", first), ("x/run2.json", second)])
    assert table.splitlines() == [
        "exchange, 2 workers at 1gbit: fp32's step, and how many times faster than it each "
        "compression was in the same run.",
        "",
        "| compression | PyTorch, run1 | TensorFlow, run2 |",
        "|---|---:|---:|",
        "| fp32 step | 900 ms | 1200 ms |",
        "| topk | 6.00× | 3.00× |",  # 0.9 / 0.15 and 1.2 / 0.4: each run's own fp32
        "| dgc | 3.00× |  |",  # not in run 2
    ]


def test_each_workload_rate_and_optimizer_is_a_table_of_its_own():
    runs = [run("fp32", 2, 1.0, rate="1gbit"), run(TOPK, 2, 0.25, rate="1gbit"),
            run("fp32", 2, 0.2), run(TOPK, 2, 0.4),
            {**run("fp32", 2, 1.0, rate="1gbit"), "optimizer": "adam"},
            {**run(TOPK, 2, 0.5, rate="1gbit"), "optimizer": "adam"}]
    tables = compare.runs_markdown([("a/r.json", runs)]).split("\n\n")
    heads = [t.splitlines()[0] for t in tables if t.startswith("exchange")]
    assert heads == [  # one table each, in the order the runs came
        "exchange, 2 workers at 1gbit: fp32's step, and how many times faster than it each "
        "compression was in the same run.",
        "exchange, 2 workers at unshaped: fp32's step, and how many times faster than it each "
        "compression was in the same run.",
        "exchange, adam, 2 workers at 1gbit: fp32's step, and how many times faster than it each "
        "compression was in the same run."]
    rows = [line for line in compare.runs_markdown([("a/r.json", runs)]).splitlines()
            if line.startswith("| topk")]
    assert rows == ["| topk | 4.00× |", "| topk | 0.50× |", "| topk | 2.00× |"]  # each to its own fp32


def test_a_run_without_fp32_leaves_its_ratios_blank_and_two_results_json_are_told_apart():
    with_fp32 = [run("fp32", 2, 1.0), run(TOPK, 2, 0.5)]
    without = [run(TOPK, 2, 0.25)]
    table = compare.runs_markdown([("out/a/results.json", with_fp32), ("out/b/results.json", without)])
    assert "| compression | PyTorch, a/results | PyTorch, b/results |" in table
    assert "| fp32 step | 1000 ms |  |" in table
    assert "| topk | 2.00× |  |" in table  # no fp32 in run b: no ratio to print


def test_by_rate_a_row_per_set_up_a_column_per_rate_the_frameworks_side_by_side():
    """``compare.by_rate.*``: the exchange's step in ms per rate, PyTorch / TensorFlow, rates in
    order of speed, a set-up a framework did not run shown as such, failed runs left out, the link's
    KiB at the slowest rate; mnist by samples/s."""
    rows = [run("fp32", 2, 0.5, 2048 * 1024, rate="unshaped"), run("fp32", 2, 1.0, 2048 * 1024, rate="1gbit"),
            run("fp32", 2, 1.2, 2049 * 1024, rate="1gbit", framework="tf"),
            run("fp32", 2, 0.6, 2048 * 1024, rate="unshaped", framework="tf"),
            run(TOPK, 4, 0.25, 40 * 1024, rate="1gbit"), run(TOPK, 4, 0.2, rate="unshaped"),
            run(TOPK, 4, 9.0, rate="unshaped", framework="tf", status="failed")]
    assert compare.by_rate_markdown(compare.medians(rows), "exchange").splitlines() == [
        "exchange: step ms (PyTorch / TensorFlow) by link rate, and KiB on one worker's link per "
        "step at 1gbit.", "",
        "| compression | workers | 1gbit | unshaped | link KiB/step |",
        "|---|---:|---:|---:|---:|",
        "| fp32 | 2 | 1000 / 1200 | 500 / 600 | 2,048 / 2,049 |",
        "| topk | 4 | 250 / – | 200 / – | 40 / – |"]
    slow = rows + [run("fp32", 2, 4.0, 2048 * 1024, rate="200mbit"), run("fp32", 2, 8.0, rate="100mbit")]
    assert compare.by_rate_markdown(compare.medians(slow), "exchange").splitlines()[2] == (
        "| compression | workers | 100mbit | 200mbit | 1gbit | unshaped | link KiB/step |")  # by speed
    assert compare.by_rate_markdown(compare.medians(rows), "mnist") == ""  # no runs of it
    mnist = [{**r, "workload": "mnist", "epochs": []} for r in rows[:2]]
    assert "| fp32 | 2 | 32 | 64 | 2,048 |" in compare.by_rate_markdown(compare.medians(mnist), "mnist")
