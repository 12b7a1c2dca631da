"""``hierarchical=True`` (issue 16): gradients summed dense within each host, compressed only
between hosts, the result shared within the host. Simulated hosts in one process
(``InProcessGroup(per_host=)``), then real Horovod workers, 2 per host, on the emulated cluster
(``scripts/cluster.py --workers-per-host``), PyTorch and TensorFlow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import grace
from grace.backends import InProcessGroup
from grace.hierarchy import owner_of
from grace.sparse import Rows
from scripts import cluster
from tests import reference
from tests.launch import ROOT, worker_env


def step(pipelines, group, grads, names, scale):
    """One step of every worker (a thread each), each tensor its own bucket."""
    def worker(rank):
        collectives = group.worker(rank)
        started = [pipelines[rank].start_bucket([g], [name], collectives)
                   for g, name in zip(grads[rank], names)]
        return [r[0] for r in pipelines[rank].finish_step(started, collectives, scale)]
    with ThreadPoolExecutor(len(pipelines)) as pool:
        return list(pool.map(worker, range(len(pipelines))))


def gaussian(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_hosts_sum_dense_and_compress_between_them():
    """2 hosts of 2 workers, four steps of top-k with error feedback: every worker gets the model's
    result (each host's sum compressed, the hosts' compressed sums added), the same bits; the
    buckets' owners spread over the hosts' workers; a host's link carries one compressed copy."""
    workers, per_host = 4, 2
    group = InProcessGroup(workers, per_host=per_host)
    pipelines = [grace.topk(0.05, hierarchical=True) for _ in range(workers)]
    model = reference.hierarchical(reference.topk_with_residual(0.05), per_host)
    names = ["a", "b"]
    for s in range(4):
        grads = [[gaussian((30, 101), 10 * s + r), gaussian((20, 60), 100 + 10 * s + r)]
                 for r in range(workers)]
        results = step(pipelines, group, grads, names, 1.0 / workers)
        for k, name in enumerate(names):
            for rank in range(1, workers):
                np.testing.assert_array_equal(results[rank][k], results[0][k])
            expected = model(name, s, [g[k].astype(np.float64) for g in grads]) / workers
            np.testing.assert_allclose(results[0][k], expected, atol=1e-6, rtol=0)
    owners = {owner_of(f"grace.{name}", per_host) for name in names}
    assert owners == {0, 1}
    stats = [p.stats() for p in pipelines]
    # The owner of a bucket sends its compressed sum; the other worker of its host sends nothing of
    # it: four steps of 5% of 3030 and of 1200 elements, values and indices, per host.
    per_host_sent = [sum(st["bytes_sent"] for st in stats[h:h + per_host]) for h in (0, per_host)]
    assert per_host_sent == [4 * (151 * 8 + 60 * 8)] * 2
    assert all(st["bytes_local"] == 4 * (3030 + 1200) * 4 for st in stats)


def test_one_host_sums_without_compressing():
    """With every worker on one host there is no slow link to compress for: the exact mean."""
    group = InProcessGroup(2, per_host=2)
    grads = [[gaussian(3000, r)] for r in range(2)]
    results = step([grace.topk(0.01, hierarchical=True) for _ in range(2)], group, grads, ["w"], 0.5)
    np.testing.assert_allclose(results[0][0], (grads[0][0] + grads[1][0]) / 2, rtol=1e-6)


def test_a_non_finite_gradient_anywhere_skips_the_step_on_every_worker():
    """An Inf on one worker of one host, in one bucket: every worker's every result is NaN, and
    no owner's state moved (the other host's, and the other bucket's owner, included)."""
    workers = 4
    group = InProcessGroup(workers, per_host=2)
    pipelines = [grace.topk(0.05, hierarchical=True) for _ in range(workers)]
    names = ["a", "b"]
    step(pipelines, group, [[gaussian(3000, r), gaussian(2000, 9 + r)] for r in range(workers)],
         names, 0.25)
    before = [p.state_dict() for p in pipelines]
    bad = [[gaussian(3000, 20 + r), gaussian(2000, 30 + r)] for r in range(workers)]
    bad[3][1][5] = np.inf
    results = step(pipelines, group, bad, names, 0.25)
    for rank in range(workers):
        assert all(np.isnan(t).all() for t in results[rank])
        after = pipelines[rank].state_dict()
        for key, value in before[rank]["memory"]["residuals"].items():
            np.testing.assert_array_equal(after["memory"]["residuals"][key], value)


def test_what_hierarchical_cannot_do_is_said():
    with pytest.raises(ValueError, match="hierarchical must be True or False"):
        grace.topk(0.01, hierarchical="yes")
    pipeline = grace.topk(0.01, hierarchical=True)
    rows = Rows(np.array([1, 3]), np.ones((2, 4), np.float32), (10, 4))
    with pytest.raises(ValueError, match="sparse_as_dense=True"):
        pipeline.start_sparse(rows, "table", InProcessGroup(2, per_host=1).worker(0))
    with pytest.raises(ValueError, match="per_host=k"):
        pipeline.start_bucket([gaussian(3000, 0)], ["w"], InProcessGroup(2).worker(0))


# --- real workers, two per host, on the emulated cluster ------------------------------------------
needs_cluster = pytest.mark.skipif(not cluster.can_emulate()[0], reason=cluster.can_emulate()[1])


def on_cluster(script, out, scenario, dynamic=True):
    env = worker_env()
    if dynamic:
        env["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "cluster.py"), "run",
                           "--hosts", "2", "--workers-per-host", "2", "--", sys.executable,
                           os.path.join(ROOT, "tests", "workers", script), str(out), "--scenarios",
                           scenario], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@needs_cluster
@pytest.mark.parametrize("script, scenario", [("torch_train.py", "topk_hierarchical"),
                                              ("tf_train.py", "tape_function_topk_hierarchical")])
def test_two_hosts_of_two_workers_match_the_model(tmp_path, script, scenario):
    proc = on_cluster(script, tmp_path, scenario)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    w, b = reference.simulate(workers=4, exchange=reference.hierarchical(
        reference.topk_with_residual(0.05), 2))
    weights = [np.load(tmp_path / f"{scenario}.rank{r}.npz") for r in range(4)]
    for r in range(4):
        np.testing.assert_array_equal(weights[r]["w"], weights[0]["w"])
    np.testing.assert_allclose(weights[0]["w"], w, atol=1e-5, rtol=0)
    np.testing.assert_allclose(weights[0]["b"], b, atol=1e-5, rtol=0)
    stats = [json.loads((tmp_path / f"{scenario}.rank{r}.json").read_text())["stats"] for r in range(4)]
    # W (1280 elements, top-k 64) is owned by one local rank, b (8, dense) by the other.
    assert sorted(st["bytes_sent"] for st in stats[:2]) == [10 * 8 * 4, 10 * 64 * 8]


@needs_cluster
def test_without_dynamic_process_sets_every_worker_says_what_to_set(tmp_path):
    proc = on_cluster("torch_train.py", tmp_path, "topk_hierarchical", dynamic=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    for rank in range(4):
        assert any(line.startswith(f"[{rank}]") and "HOROVOD_DYNAMIC_PROCESS_SETS=1 in the environment"
                   in line for line in output.splitlines()), output[-3000:]
