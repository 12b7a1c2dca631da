"""``stats()`` is exactly what went into Horovod's collectives: on real workers (2 and 3), for every
communicator, with the collectives of horovod.torch intercepted (tests/workers/torch_stats.py)."""

from __future__ import annotations

import json
import os

import pytest

from tests.launch import ROOT, horovodrun

WORKER = os.path.join(ROOT, "tests", "workers", "torch_stats.py")
CASES = ["none", "fp16", "randomk", "powersgd", "topk", "threshold", "adaq", "qsgd", "topk_broadcast",
         "signsgd_broadcast", "dgc_warmup", "inceptionn", "inceptionn_dense"]


@pytest.fixture(scope="module", params=[2, 3])
def counts(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"stats{request.param}") / "stats.json"
    horovodrun(WORKER, str(out), np=request.param)
    return request.param, json.loads(out.read_text())


@pytest.mark.parametrize("name", CASES)
def test_stats_equal_the_bytes_put_into_horovods_collectives(counts, name):
    size, per_rank = counts
    assert len(per_rank) == size
    for rank, results in enumerate(per_rank):
        run = results[name]
        assert run["counted"] > 0
        assert run["stats"] == run["counted"], (rank, run)


def test_broadcast_counts_a_tensor_in_every_workers_broadcast(counts):
    size, per_rank = counts
    topk, broadcast = per_rank[0]["topk"], per_rank[0]["topk_broadcast"]
    # The same payloads: gathered once, or broadcast by each of the n workers into the others'.
    assert broadcast["bytes_sent"] - dense_part(per_rank[0], "topk_broadcast") == \
        size * (topk["bytes_sent"] - dense_part(per_rank[0], "topk"))


def test_inceptionn_that_would_not_shrink_sends_exactly_the_dense_bytes(counts):
    """Every element in the 32-bit class: the workers agree to send the tensors dense, which costs
    their bytes exactly, where each deciding alone would have added its lengths to say so."""
    _, per_rank = counts
    for results in per_rank:
        run = results["inceptionn_dense"]
        assert run["bytes_sent"] == run["bytes_dense"]
        assert results["inceptionn"]["bytes_sent"] < results["inceptionn"]["bytes_dense"]


def dense_part(results, name):
    """The biases' bytes (below min_numel, allreduced as they are): 48 + 32 floats, 4 steps."""
    return 4 * (48 + 32) * 4
