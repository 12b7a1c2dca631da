"""A real Horovod elastic job (``horovodrun --min-np 2 --max-np 3 --host-discovery-script``) with
grace's top-k: a worker is removed after step 4 and a new one joins after step 8
(tests/workers/torch_elastic.py). What docs/reliability.md promises: the survivors keep their
compression state across each reset, the worker that joins starts with none, every worker holds
the same weights, and every step's update is the mean of what the workers sent at the job's size
of that step (against a numpy model of top-k with error feedback)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

from tests.launch import HOROVODRUN, ROOT, worker_env

# Minutes long: in `make test-slow` and CI, not in `make test` (Makefile).
pytestmark = pytest.mark.slow

WORKER = os.path.join(ROOT, "tests", "workers", "torch_elastic.py")
EMPTY = "e3b0c44298fc1c14"  # the digest of no residuals: a worker that has not stepped
SIZES = [3] * 4 + [2] * 4 + [3] * 4  # steps 0-3, 4-7 (one removed), 8-11 (one joined)


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    (out / "hosts").write_text("localhost:2\n127.0.0.1:1\n")
    discover = out / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {out / 'hosts'}\n")
    discover.chmod(0o755)
    # A removed worker's exit blacklists its host; a short cool-down lets it come back.
    cmd = [HOROVODRUN, "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
           str(discover), "--blacklist-cooldown-range", "1", "2", sys.executable, WORKER, str(out), "topk"]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    by_process = {}
    for log in out.glob("log.*"):
        by_process[log.name] = [json.loads(line) for line in log.read_text().splitlines()]
    return by_process, output


def test_a_worker_leaves_and_another_joins(events):
    by_process, output = events
    assert len(by_process) == 4  # three at the start, one that joins
    steps = collections.Counter(e["step"] for log in by_process.values() for e in log if e["event"] == "step")
    assert [steps[s] for s in range(12)] == SIZES
    for log in by_process.values():
        assert all(e["size"] == SIZES[e["step"]] for e in log if e["event"] == "step")
    removed = [log for log in by_process.values() if max(e["step"] for e in log) == 3]
    joined = [log for log in by_process.values() if log[0]["step"] == 8]
    assert len(removed) == 1 and len(joined) == 1
    # said once, by rank 0 (the joiner, rank 2, says nothing)
    assert output.count("workers' compression is not compared as the wrapper is built") == 1


def test_every_worker_votes_at_every_step(events):
    """The sparse-gradient vote at every step, the joiner's first included: the same control bytes
    (the vote's 8 for one parameter and the step's other votes) at each step of every worker. A
    vote held once per process would leave the survivors' later steps 8 bytes short."""
    by_process, _ = events
    control = {e["control"] for log in by_process.values() for e in log if e["event"] == "step"}
    assert len(control) == 1 and control.pop() >= 8


def test_survivors_keep_their_compression_state_and_the_joiner_starts_empty(events):
    by_process, _ = events
    syncs = [e for log in by_process.values() for e in log if e["event"] == "sync"]
    after_reset = [e for e in syncs if e["step"] in (4, 8)]
    survivors = [e for e in after_reset if e["committed"] is not None]
    assert len(survivors) == 2 + 2
    for e in survivors:
        assert e["now"] == e["committed"] != EMPTY  # what it committed, not rank 0's nor nothing
    assert len({e["now"] for e in survivors if e["step"] == 8}) == 2  # each its own residual
    joiner = [e for e in after_reset if e["committed"] is None]
    assert [(e["step"], e["now"], e["size"]) for e in joiner] == [(8, EMPTY, 3)]


def test_every_step_is_the_mean_of_what_the_workers_sent_and_weights_agree(events):
    by_process, _ = events
    weights = collections.defaultdict(set)
    for log in by_process.values():
        for e in log:
            if e["event"] == "step":
                assert e["error"] < 1e-6, e
                weights[e["step"]].add(e["weights"])
    assert all(len(digests) == 1 for digests in weights.values())
    assert len(weights) == 12


class OneOfTwo:
    """Horovod's process set as a wrapper sees it: this worker is ``rank`` of 2."""

    def __init__(self, rank: int):
        self._rank = rank

    def included(self) -> bool:
        return True

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2


def test_the_comparison_at_construction_is_left_out_only_in_an_elastic_job(monkeypatch, caplog):
    """Both frameworks' wrappers ask ``compares_at_construction`` (PyTorch's optimizer, TensorFlow's
    eager wrappers): outside an elastic job they compare; inside, they do not, and rank 0 says so
    once."""
    from frameworks import process_set

    monkeypatch.setattr(process_set, "_TOLD", set())
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    assert process_set.compares_at_construction(OneOfTwo(0)) and not process_set.elastic()
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert process_set.elastic()
    for rank, said in ((1, []), (0, [process_set.ELASTIC_LINE])):  # each a worker of its own
        monkeypatch.setattr(process_set, "_TOLD", set())
        caplog.clear()
        with caplog.at_level("WARNING", logger="grace"):
            assert not process_set.compares_at_construction(OneOfTwo(rank))
            assert not process_set.compares_at_construction(OneOfTwo(rank))  # a second wrapper
        assert [r.getMessage() for r in caplog.records] == said
