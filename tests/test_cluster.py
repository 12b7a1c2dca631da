"""The emulated cluster (scripts/cluster.py) and the side-by-side comparison (scripts/compare.py) on
real namespaces, real tc shaping and real Horovod workers. They need root, which the project's CI
machine has; elsewhere compare.py falls back to localhost, and these tests do not apply."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from scripts import cluster, compare
from tests.launch import ROOT

# Minutes long: in `make test-slow` and CI, not in `make test` (Makefile).
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cluster.can_emulate()[0], reason=cluster.can_emulate()[1])]


def mine(tag: str) -> list[str]:
    return [ns for ns in cluster.namespaces() if ns.startswith(f"{cluster.PREFIX}{tag}-")]


def test_set_up_and_torn_down_also_on_error():
    with cluster.EmulatedCluster(3, "200mbit", tag="9101") as net:
        assert sorted(mine("9101")) == sorted(net.names + [net.switch])
        assert cluster.measure_throughput(net, 2**16, src=2, dst=0) > 0  # hosts reach each other
        qdisc = subprocess.run(net.exec_args(1, ["tc", "qdisc", "show", "dev", "eth0"]),
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "200Mbit" in qdisc
    assert mine("9101") == []
    assert not any(name.startswith(f"{cluster.PREFIX}9101-") for name in os.listdir(cluster.ETC_NETNS))

    with pytest.raises(RuntimeError, match="boom"):
        with cluster.EmulatedCluster(2, tag="9102"):
            assert len(mine("9102")) == 3
            raise RuntimeError("boom")
    assert mine("9102") == []


def test_torn_down_on_ctrl_c():
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "cluster.py"), "run",
                             "--hosts", "2", "--", "sleep", "120"], cwd=ROOT)
    tag = f"{proc.pid % 10000}"
    deadline = time.time() + 60
    while len(mine(tag)) < 3 and time.time() < deadline:
        time.sleep(0.2)
    assert len(mine(tag)) == 3, "the cluster did not come up"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert mine(tag) == []


def test_bad_rate_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="rate must look like"):
        cluster.EmulatedCluster(2, "fast")
    with pytest.raises(ValueError, match="hosts must be at least 1"):
        cluster.EmulatedCluster(0)


def test_hosts_get_cores_of_their_own_or_share_them_round_robin():
    assert [cluster.host_cpus(h, 2, cpus=2) for h in range(2)] == [[0], [1]]
    assert [cluster.host_cpus(h, 2, cpus=5) for h in range(2)] == [[0, 1], [2, 3]]
    assert [cluster.host_cpus(h, 3, cpus=2) for h in range(3)] == [[0], [1], [0]]
    assert cluster.host_cpus(0, 1, cpus=2) == [0, 1]


def test_shaped_link_limits_a_transfer():
    """A TCP transfer of 4 MiB across a 40 Mbit/s link runs at that rate (TCP and framing overheads
    keep it a little under; the token bucket's burst lets it start a little over), while the
    unshaped link runs far faster."""
    with cluster.EmulatedCluster(2, "40mbit") as net:
        shaped = cluster.measure_throughput(net, 4 * 2**20)
    assert 0.8 * 40e6 < shaped < 1.1 * 40e6, shaped
    with cluster.EmulatedCluster(2) as net:
        unshaped = cluster.measure_throughput(net, 16 * 2**20)
    assert unshaped > 10 * 40e6, unshaped


def test_two_host_comparison_on_tiny_settings(tmp_path):
    """Both frameworks on 2 emulated hosts at 20 Mbit/s, uncompressed against top-k: every run
    reports; the uncompressed allreduce puts each gradient byte on the wire once each way (ring on 2
    workers), top-k's payload is 1% values plus indices, it makes the step faster on this link, and
    both learn."""
    results = compare.main(["--workloads", "mnist", "--frameworks", "torch,tf",
                            "--compressors", "fp32,topk:ratio=0.01", "--rates", "20mbit",
                            "--workers", "2", "--epochs", "1", "--steps", "4", "--out",
                            str(tmp_path)])
    assert [r["status"] for r in results] == ["ok"] * 4
    dense = 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    for fw in ("torch", "tf"):
        fp32, topk = (next(r for r in results if r["framework"] == fw and label in r["compression"])
                      for label in ("fp32", "topk"))
        assert fp32["bytes_per_step"] == dense * 4
        assert 2 * dense * 4 < fp32["wire_bytes_per_step"] < 2.3 * dense * 4
        assert topk["bytes_per_step"] < fp32["bytes_per_step"] / 40
        assert topk["step_s"] < fp32["step_s"] / 2
        # Four steps of momentum SGD take the MLP from chance (0.10) to 0.58-0.73 here, compressed or
        # not; a run whose gradients were not combined and applied would stay near 0.10.
        assert fp32["epochs"][0]["test_accuracy"] > 0.4
        assert topk["epochs"][0]["test_accuracy"] > 0.4
    for name in ("results.csv", "results.md", "results.json", "throughput_vs_rate_mnist.png",
                 "test_accuracy_vs_time_mnist.png", "torch_vs_tf.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| torch | topk(ratio=0.01) | 20mbit | 2 | ok |" in (tmp_path / "results.md").read_text()


def test_an_optimizer_other_than_sgd_or_adam_is_refused_before_any_run(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--optimizer", "rmsprop", "--out", "/nonexistent"])
    assert "--optimizer: invalid choice: 'rmsprop' (choose from 'sgd', 'adam')" in capsys.readouterr().err


HOSTS_PROBE = """
import json, os, torch, horovod.torch as hvd
hvd.init()
def eth0():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())
before = eth0()
hvd.allreduce(torch.ones(2**20), name="probe")  # 4 MiB each way around the ring
print("PROBE " + json.dumps([hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                             hvd.cross_size(), eth0() - before, sorted(os.sched_getaffinity(0))]),
      flush=True)
"""


def probe(tmp_path, hosts, per_host):
    script = tmp_path / "probe.py"
    script.write_text(HOSTS_PROBE)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "cluster.py"), "run",
                          "--hosts", str(hosts), "--workers-per-host", str(per_host), "--",
                          sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line.split("PROBE ", 1)[1]) for line in out.stdout.splitlines() if "PROBE " in line]
    return sorted(rows)


def test_several_workers_per_host_are_local_ranks_and_talk_over_loopback(tmp_path):
    """2 hosts x 2 workers: Horovod sees two local ranks per host and two hosts; an allreduce of
    4 MiB among workers of one host puts nothing on its link, across hosts it does."""
    rows = probe(tmp_path, 2, 2)
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
        (0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (2, 0, 2, 1, 2), (3, 1, 2, 1, 2)]
    # Each host's workers on its own cores (the machine's split between the 2 hosts).
    assert [r[6] for r in rows] == [cluster.host_cpus(r[3], 2) for r in rows]
    assert set(rows[0][6]).isdisjoint(rows[2][6])
    alone = probe(tmp_path, 1, 2)  # one host: the ring stays inside it
    assert all(r[5] < 2**20 for r in alone), alone
    apart = probe(tmp_path, 2, 1)
    assert all(r[5] > 4 * 2**20 for r in apart), apart


def test_ddp_beside_horovod_on_two_hosts(tmp_path):
    """``--engines horovod,ddp``: PyTorch through Horovod and through DDP (one torchrun per emulated
    host) in one table. Each engine runs only its own baselines (Horovod's fp16 under Horovod,
    PyTorch's fp16 hook under DDP). Given the same seed, DDP without a hook trains exactly as
    Horovod's fp32 and grace's top-k with plain error feedback through grace.ddp_hook exactly as
    through Horovod (the same accuracy to the last digit, the same payload); PyTorch's fp16 hook
    sends two bytes an element, and the emulated links carry about half of what DDP's own allreduce
    puts on them. Top-k's default memory would differ by engine: under Horovod it takes SGD's
    momentum over, which a DDP hook cannot see (docs/ddp.md), hence ``memory=residual`` here."""
    results = compare.main(["--workloads", "mnist", "--frameworks", "torch", "--engines", "horovod,ddp",
                            "--compressors", "fp32,hvd-fp16,torch-fp16,topk:ratio=0.01;memory=residual",
                            "--rates", "200mbit", "--workers", "2", "--epochs", "2", "--steps", "4",
                            "--alone", "--out", str(tmp_path)])
    alone = [r for r in results if r["rate"] == compare.ALONE]
    assert [(r["framework"], r["compression"]) for r in alone] == [("torch", "fp32")]  # one, shared
    limits = compare.alone_limits(results)
    assert limits[("mnist", "ddp")] == limits[("mnist", "torch")] == alone[0]["samples_per_s"]
    runs = {(r["framework"], compare.label(r["compression"])): r for r in results
            if r["rate"] != compare.ALONE}
    topk = "topk(ratio=0.01, memory=residual)"
    assert sorted(runs) == sorted([("torch", "fp32"), ("torch", "hvd-fp16"), ("torch", topk),
                                   ("ddp", "fp32"), ("ddp", "torch-fp16"), ("ddp", topk)])
    assert all(r["status"] == "ok" for r in results), [r["status"] for r in results]
    dense = 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    for name in ("fp32", topk):
        horovod, ddp = runs[("torch", name)], runs[("ddp", name)]
        assert [e["test_accuracy"] for e in ddp["epochs"]] == [e["test_accuracy"] for e in horovod["epochs"]]
        assert ddp["bytes_per_step"] == horovod["bytes_per_step"]
    assert runs[("ddp", "fp32")]["bytes_per_step"] == 4 * dense
    assert runs[("ddp", "torch-fp16")]["bytes_per_step"] == 2 * dense
    fp32_wire = runs[("ddp", "fp32")]["wire_bytes_per_step"]
    assert 2 * dense * 4 < fp32_wire < 2.3 * dense * 4  # the ring on 2 workers: each byte once each way
    assert 0.45 < runs[("ddp", "torch-fp16")]["wire_bytes_per_step"] / fp32_wire < 0.55
    topk_wire = [runs[(fw, topk)]["wire_bytes_per_step"] for fw in ("torch", "ddp")]
    assert 0.8 < topk_wire[1] / topk_wire[0] < 1.25 and topk_wire[1] < fp32_wire / 20
    assert "| ddp | torch-fp16 | 200mbit | 2 | ok |" in (tmp_path / "results.md").read_text()
    assert "PyTorch DDP per worker" in (tmp_path / "end_to_end.md").read_text()
