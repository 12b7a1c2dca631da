"""grace's compressors as a PyTorch DDP communication hook, on real workers (``torchrun``, Gloo): the
trained weights against the numpy models of the algorithms and against the same compressor under
Horovod, bit for bit; DDP's semantics (bucket rebuild, ``no_sync``, resume, a non-finite step);
the workers' mismatch; the bytes counted; no Horovod imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import grace
from scripts import cluster
from tests import reference
from tests.launch import ROOT, worker_env
from tests.test_horovod_torch import STEPS_TRAINED, check, load  # the same checks as under Horovod

WORKER = os.path.join(ROOT, "tests", "workers", "ddp_train.py")
TOPK_BYTES = 10 * (64 * 4 + 64 * 4 + 8 * 4)  # per step: 64 float32 values, 64 int32 indices, b dense


def torchrun(out, *args, nproc=2, worker=WORKER):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", worker,
           str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """tests/workers/ddp_train.py on 2 Gloo workers, every scenario: (folder, the job's output)."""
    out = tmp_path_factory.mktemp("ddp")
    return out, torchrun(out)


def test_topk_with_error_feedback_matches_the_numpy_model(ddp_run):
    out, _ = ddp_run
    infos = check(out, "topk", reference.simulate(reference.topk_with_residual(0.05)))
    stats = infos[0]["stats"]
    assert stats["bytes_sent"] == TOPK_BYTES
    assert stats["bytes_dense"] == 10 * (1280 + 8) * 4 and stats["tensors"] == 20


def test_a_momentum_given_to_dgc_applies_to_the_dense_tensors_too(ddp_run):
    """``grace.dgc(momentum=0.9)`` in the hook and an SGD without momentum, as docs/ddp.md has a
    user with momentum SGD write: W's velocity before compression, and b's, which travels dense
    (below ``min_numel``), before the exchange: within 1e-5 of the numpy model of Horovod's
    wrapper taking SGD's 0.9 over (tests/test_momentum.py holds the wrapper to the same)."""
    from tests.test_momentum import DENSE_MOMENTUM, M

    out, _ = ddp_run
    check(out, "dgc_given", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True), momentum=DENSE_MOMENTUM))


def test_uncompressed_hook_is_plain_averaging(ddp_run):
    out, _ = ddp_run
    infos = check(out, "none", reference.simulate())
    assert infos[0]["stats"]["bytes_sent"] == infos[0]["stats"]["bytes_dense"] == 10 * 1288 * 4


def test_topk_through_the_shard_owners_over_all_to_all_single(ddp_run):
    out, _ = ddp_run
    infos = check(out, "topk_alltoall", reference.simulate(exchange=reference.two_stage_topk(0.05, 2)))
    assert infos[0]["stats"]["bytes_sent"] == 10 * (32 * 8 + 64 * 8 + 2 * 4 + 8 * 4)


def test_no_sync_accumulates_before_a_stateful_compressor(ddp_run):
    """Two micro-batches, the first under ``no_sync()``: top-k with error feedback compresses the
    sum once, as Horovod's ``backward_passes_per_step=2`` does."""
    out, _ = ddp_run
    check(out, "topk_nosync", reference.simulate(reference.topk_with_residual(0.05), passes=2))


def test_resume_from_state_dict_is_bit_exact(ddp_run):
    """Five steps, the compression state saved with the model and optimizer, a new DDP model and a
    new pipeline loaded, five more: the weights of ten uninterrupted steps, bit for bit."""
    out, _ = ddp_run
    resumed, infos = load(out, "resume")
    straight, straight_infos = load(out, "topk")
    for r in range(2):
        np.testing.assert_array_equal(resumed[r]["w"], straight[r]["w"])
        np.testing.assert_array_equal(resumed[r]["b"], straight[r]["b"])
    assert infos[0]["stats"] == straight_infos[0]["stats"]  # the byte counts are state too


def test_a_non_finite_step_leaves_no_trace(ddp_run):
    """At step 3 rank 1's loss is infinite: every worker gets NaN for every gradient (the step is
    skipped, as a loss scaler skips it) and the residuals stay as they were, so the run ends where a
    run that never took step 3 ends, bit for bit."""
    out, _ = ddp_run
    poisoned, infos = load(out, "topk_nonfinite")
    skipped, _ = load(out, "topk_skip3")
    assert [i["skipped"] for i in infos] == [[3], [3]]
    for r in range(2):
        np.testing.assert_array_equal(poisoned[r]["w"], skipped[r]["w"])
        np.testing.assert_array_equal(poisoned[r]["b"], skipped[r]["b"])


def assert_same(a, b):
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_residuals_stay_with_their_parameters_when_ddp_rebuilds_its_buckets(ddp_run):
    """A model of four layers of different shapes whose forward uses them in another order than
    it registers them: with small buckets DDP regroups them after the first iteration. Top-k and
    DGC compress each tensor on its own, so small buckets (regrouped), one large bucket, and DDP's
    first buckets never rebuilt (``find_unused_parameters=True``) end bit for bit alike only if
    every residual follows its parameter; ``gradient_as_bucket_view`` and ``static_graph`` too.
    Buckets of one weight each (biases frozen): DDP's buffer is then all of the gradient's memory,
    which DDP fills anew each step, so a residual kept in it would be lost."""
    out, _ = ddp_run
    small, small_info = load(out, "tower_small")
    layouts = small_info[0]["layouts"]
    assert len(layouts[0]) < len(layouts[1]) and layouts[0] != layouts[1]  # regrouped
    assert layouts[1] == layouts[5]  # once
    unused, unused_info = load(out, "tower_unused")
    assert all(layout == unused_info[0]["layouts"][0] for layout in unused_info[0]["layouts"])
    for other in ("tower_large", "tower_unused", "tower_view", "tower_static"):
        runs, _ = load(out, other)
        for r in range(2):
            assert_same(small[r], runs[r])
    tiny, tiny_info = load(out, "tower_frozen_tiny")
    assert all(len(bucket) == 1 for bucket in tiny_info[0]["layouts"][-1])
    frozen_large, _ = load(out, "tower_frozen_large")
    for r in range(2):
        assert_same(tiny[r], frozen_large[r])
        assert not np.array_equal(tiny[r]["layers.1.weight"], small[r]["layers.1.weight"])
    dgc_small, _ = load(out, "tower_dgc_small")
    dgc_large, _ = load(out, "tower_dgc_large")
    for r in range(2):
        assert_same(small[r], small[0])
        assert_same(dgc_small[r], dgc_large[r])
    assert small_info[0]["stats"]["bytes_sent"] < small_info[0]["stats"]["bytes_dense"] / 5
    # Finite, and DGC's weights differ from top-k's: the comparisons above are not vacuous.
    assert all(np.isfinite(small[0][k]).all() for k in small[0].files)
    assert any(not np.array_equal(small[0][k], dgc_small[0][k]) for k in small[0].files)


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_a_bucket_of_none_or_fp16_is_summed_in_place_and_decoded_into_itself(ddp_run, name):
    """On real workers (the tower in DDP's one default bucket of its 8 tensors, 6 steps), none's
    and fp16's bucket takes one collective a step, given its tensor to sum in place (none: DDP's
    bucket itself; fp16: the bucket cast as one vector), never a copy; and every result is at its
    place in DDP's bucket when the step ends, so the hook writes nothing back."""
    out, _ = ddp_run
    for r in range(2):
        with open(out / f"in_place_{name}.counts.rank{r}.json") as f:
            counts = json.load(f)
        assert counts == {"given": 6, "copied": 0, "written": 0, "in_place": 6 * 8}, counts
    _, infos = load(out, f"in_place_{name}")
    assert [len(bucket) for bucket in infos[0]["layouts"][-1]] == [8]


def test_a_non_finite_gradient_in_one_bucket_poisons_every_bucket_and_leaves_no_trace(ddp_run):
    """At step 3 one weight's gradient on the last rank is infinite, in a bucket of its own among
    several: every gradient of every bucket comes out NaN on every worker (one verdict for the
    step), and the run ends where one that never took step 3 ends, bit for bit."""
    out, _ = ddp_run
    poisoned, infos = load(out, "tower_nonfinite")
    skipped, _ = load(out, "tower_skip3")
    assert len(infos[0]["layouts"][3]) > 1  # several buckets in the poisoned step
    for info in infos:
        assert [any(f) for f in info["finite"]] == [True, True, True, False, True, True]
        assert info["finite"][3] == [False] * 8
    for r in range(2):
        assert_same(poisoned[r], skipped[r])


def test_workers_that_compress_differently_get_the_same_clear_error(ddp_run):
    out, _ = ddp_run
    _, infos = load(out, "mismatch")
    for info in infos:
        assert info["error"].startswith("ValueError: grace: the workers are not set up alike")
        assert "TopK(ratio=0.05)" in info["error"] and "TopK(ratio=0.02)" in info["error"]


def test_sparse_gradients_travel_as_rows(ddp_run):
    """An embedding with sparse gradients (DDP's bucket of its own): its rows, repeats added up,
    averaged over the workers (``grace.none()``) or top-k with error feedback on the rows, against
    the numpy model of tests/workers/sparse_model.py, as under Horovod
    (tests/test_sparse_workers.py)."""
    from tests.workers import sparse_model

    out, _ = ddp_run
    for name, ratio, tol in (("rows_none", None, 1e-6), ("rows_topk", 0.05, 1e-5)):
        runs, infos = load(out, name)
        E, W = sparse_model.numpy_run(5, ratio, 2)
        for r in range(2):
            assert infos[r]["sparse"] == [True] * 5  # the gradient stayed sparse
            np.testing.assert_array_equal(runs[r]["E"], runs[0]["E"])
        np.testing.assert_allclose(runs[0]["E"], E, atol=tol, rtol=0)
        np.testing.assert_allclose(runs[0]["W"], W, atol=tol, rtol=0)
        E0, _ = sparse_model.initial_weights()
        assert np.abs(runs[0]["E"] - E0).max() > 100 * tol
    none_stats = load(out, "rows_none")[1][0]["stats"]
    topk_stats = load(out, "rows_topk")[1][0]["stats"]
    assert topk_stats["bytes_dense"] == none_stats["bytes_dense"]
    assert topk_stats["bytes_sent"] < none_stats["bytes_sent"] / 3


def test_what_users_get_wrong_is_a_clear_error(ddp_run):
    out, _ = ddp_run
    _, infos = load(out, "errors")
    for found in infos:
        assert found["sparse_hierarchical"].startswith("ValueError: hierarchical=True sums each "
                                                       "host's gradients dense")
        assert found["unnamed"].startswith("ValueError: a parameter DDP reduces is not in "
                                           "named_parameters")
        assert found["reused"].startswith("ValueError: a parameter this compression object has "
                                          "not seen before")
        assert found["twice"].startswith("ValueError: this compression object already serves a "
                                         "DDP model")


def test_no_horovod_is_imported(ddp_run):
    out, _ = ddp_run
    for r in range(2):
        assert json.loads((out / f"modules.rank{r}.json").read_text()) == {"horovod": False}


def test_rank_zero_says_where_the_hook_sees_no_optimizer(ddp_run):
    """What a takeover does under Horovod is said once, by rank 0 alone."""
    _, output = ddp_run
    line = ("grace: randomk's error feedback delays each element about 1/ratio steps, and an "
            "optimizer's momentum on those delayed updates diverges (docs/quality.md): a DDP "
            "communication hook sees no optimizer to turn it off, so give the optimizer no momentum")
    assert output.count(line) == 1
    assert output.count("grace: onebit applies the momentum itself, before compression, where it "
                        "is given one, and a DDP communication hook sees no optimizer") == 1


@pytest.mark.parametrize("name", grace.available())
def test_every_compressor_computes_what_it_computes_under_horovod(ddp_run, gloo_run, name):
    """The same pipeline under DDP (parameters named by ``grace.DDPState(named_parameters=...)``,
    as Horovod's ``named_parameters=`` names them, so the stochastic compressors draw the same
    numbers) and under ``hvd.DistributedOptimizer``: the same weights, bit for bit, and the same
    bytes (Horovod's wrapper adds one 16-byte agreement on which gradients are sparse)."""
    out, _ = ddp_run
    ddp, ddp_infos = load(out, f"catalogue_{name}")
    hvd, hvd_infos = load(gloo_run, f"catalogue_{name}")
    w0, _ = reference.init_weights(0)
    assert np.isfinite(ddp[0]["w"]).all() and np.abs(ddp[0]["w"] - w0).max() > 1e-4
    for r in range(2):
        np.testing.assert_array_equal(ddp[r]["w"], hvd[r]["w"].astype(np.float64))
        np.testing.assert_array_equal(ddp[r]["b"], hvd[r]["b"].astype(np.float64))
    a, b = ddp_infos[0]["stats"], hvd_infos[0]["stats"]
    for key in ("bytes_sent", "bytes_dense", "tensors", "bytes_received"):
        assert a[key] == b[key], key
    # DGC's (its momentum given, as CATALOGUE_OPTIONS has it) reaches b, which travels dense (its
    # payload would not be smaller): b's velocity is state a non-finite step rolls back, so b
    # carries a 4-byte flag; Horovod's wrapper buckets b apart from W (another route), one flag
    # each a step, where DDP's one bucket holds both, one flag.
    apart = 4 * STEPS_TRAINED if name == "dgc" else 0
    assert a["bytes_control"] == b["bytes_control"] - 16 - apart


def test_bucket_granularity_compresses_each_ddp_bucket_as_one_vector_from_the_second_step(ddp_run):
    """``granularity="bucket"``: the process's first step travels dense through DDP's own allreduce
    (DDP regroups its buckets after it, which would leave a joined residual with the wrong tensors),
    and from the second each DDP bucket's tensors (W and b, one bucket) are compressed as one vector
    with its residual: top-k keeps 64 of the 1,288 entries, against the numpy model, and rank 0
    says why the first step is dense."""
    out, output = ddp_run
    topk = reference.topk_with_residual(0.05)

    def first_dense(name, rank, step, g):
        return g if step == 0 else topk(name, rank, step, g)
    infos = check(out, "topk_bucket", reference.simulate(first_dense, joined=True))
    assert infos[0]["stats"]["bytes_sent"] == 9 * 64 * 8  # 64 values and their indices, 9 steps
    assert output.count("granularity='bucket' under DDP: the first step of this process travels "
                        "dense") == 1


def test_bucket_granularity_resumes_with_its_residual_waiting_one_dense_step(ddp_run):
    """``granularity="bucket"``, five steps, saved, a new DDP model and pipeline loaded, five more:
    the resumed process's first step travels dense again, and the residual saved at step 4 enters
    at step 6, not lost: the numpy model with steps 0 and 5 dense and one residual carried
    across."""
    out, _ = ddp_run
    topk = reference.topk_with_residual(0.05)

    def dense_at_starts(name, rank, step, g):
        return g if step in (0, 5) else topk(name, rank, step, g)
    infos = check(out, "resume_bucket", reference.simulate(dense_at_starts, joined=True))
    assert infos[0]["stats"]["bytes_sent"] == 8 * 64 * 8  # compressed steps 1-4 and 6-9


def test_bucket_granularity_keeps_one_residual_per_bucket_as_ddp_regrouped_them(ddp_run):
    """Small buckets, which DDP regroups after the first step: with ``granularity="bucket"`` the
    residuals are exactly one per bucket of the regrouped layout, each named after the bucket's
    first tensor; none is left from the first step's buckets (that step travelled dense)."""
    out, _ = ddp_run
    _, infos = load(out, "tower_bucket")
    layouts = infos[0]["layouts"]
    assert layouts[0] != layouts[1] and layouts[1] == layouts[5]  # regrouped once
    first = {f"bucket.{layout[0]}" for layout in layouts[0]}
    final = {f"bucket.{layout[0]}" for layout in layouts[1]}
    assert first != final
    for info in infos:
        assert info["residual_names"] == sorted(final)
        assert info["stats"]["bytes_sent"] < info["stats"]["bytes_dense"] / 5


def test_state_must_be_a_pipeline():
    from frameworks.torch.ddp import DDPState, state_for

    with pytest.raises(TypeError, match="must be a grace pipeline"):
        state_for(object())
    with pytest.raises(ValueError, match="hierarchical=True groups the job's workers by host"):
        DDPState(grace.topk(0.01, hierarchical=True), process_group=object())
    compression = grace.topk(0.01)
    assert state_for(compression) is state_for(compression)  # one state, kept on the pipeline


def test_importing_grace_needs_no_torch_or_horovod():
    code = ("import sys; import grace; grace.topk(0.01); "
            "print(sorted(m for m in ('torch', 'horovod', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=worker_env(),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- two hosts of two workers each, on the emulated cluster: one torchrun per host ----------------
needs_cluster = pytest.mark.skipif(not cluster.can_emulate()[0], reason=cluster.can_emulate()[1])


@needs_cluster
def test_two_hosts_flat_and_hierarchical_over_subgroups(tmp_path):
    """torchrun on each emulated host (``--nnodes 2``, the rendezvous at host 0's address). Flat
    top-k matches the 4-worker model; ``hierarchical=True`` sums each host's gradients dense (a
    subgroup), compresses between hosts (another) and matches the hierarchical model, its first
    step dense (DDP regroups its buckets after it, see frameworks/torch/ddp.py)."""
    env = worker_env()
    with cluster.EmulatedCluster(2) as hosts:
        code, output = hosts.torchrun(2, [WORKER, str(tmp_path), "--scenarios",
                                          "topk,topk_hierarchical"], env=env, timeout=600)
    assert code == 0, output[-6000:]
    check(tmp_path, "topk", reference.simulate(reference.topk_with_residual(0.05), workers=4),
          ranks=4)
    topk = reference.topk_with_residual(0.05)

    def first_dense(name, host, step, g):
        return g if step == 0 else topk(name, host, step, g)
    infos = check(tmp_path, "topk_hierarchical",
                  reference.simulate(workers=4, exchange=reference.hierarchical(first_dense, 2)),
                  ranks=4)
    # One worker of each host compresses the bucket (W top-k 64, b dense), from the second step.
    per_owner = 9 * (64 * 8 + 8 * 4)
    assert sorted(i["stats"]["bytes_sent"] for i in infos) == [0, 0, per_owner, per_owner]
    assert "hierarchical=True under DDP: the first step of this process travels dense" in output


def test_a_buckets_gradients_are_joined_as_a_view_and_written_back_in_one_pass():
    """DDP's gradients are views of its bucket's flat buffer: ``TorchOps.adjacent`` joins them as
    a view of it (no copy), and nothing else (a gap, another order, another dtype, a strided
    view); the hook's write-back leaves a result already in its place alone, copies the others
    in, and reads a result lying elsewhere in the bucket before anything is written over it."""
    import torch

    from frameworks.torch.ddp import _write_into
    from frameworks.torch.ops import TorchOps

    ops = TorchOps()
    buffer = torch.arange(10.0)
    a, b, c = buffer[0:4].view(2, 2), buffer[4:7], buffer[7:10]
    joined = ops.adjacent([a, b, c])
    assert joined.data_ptr() == buffer.data_ptr() and tuple(joined.shape) == (10,)
    joined[5] = -1.0
    assert buffer[5] == -1.0
    assert ops.adjacent([a, c]) is None
    assert ops.adjacent([b, a]) is None
    assert ops.adjacent([buffer[0:4], buffer.view(torch.int32)[4:7]]) is None
    assert ops.adjacent([buffer[0:8:2], buffer[8:10]]) is None
    assert ops.adjacent([buffer[0:4], torch.zeros(3)]) is None
    assert ops.adjacent([buffer[0:4].view(2, 2).t(), buffer[4:10]]) is None  # not contiguous
    later = ops.adjacent([b, c])  # from an offset in the buffer
    assert later.data_ptr() == b.data_ptr() and tuple(later.shape) == (6,)
    assert later.tolist() == buffer[4:10].tolist()

    buffer = torch.arange(10.0)
    results = [buffer[6:10].view(2, 2), buffer[4:6], torch.tensor([7.0, 8.0, 9.0, 10.0])]
    _write_into(buffer, results)
    assert buffer.tolist() == [6.0, 7.0, 8.0, 9.0, 4.0, 5.0, 7.0, 8.0, 9.0, 10.0]
    buffer = torch.arange(4.0)
    _write_into(buffer, [buffer.view(2, 2).t()])  # at its place, but transposed: written
    assert buffer.tolist() == [0.0, 2.0, 1.0, 3.0]
    buffer = torch.arange(6.0)
    _write_into(buffer, [torch.full((3,), -1.0), buffer[0:3]])  # read before 0:3 is written
    assert buffer.tolist() == [-1.0, -1.0, -1.0, 0.0, 1.0, 2.0]
    buffer = torch.zeros(5)
    _write_into(buffer, [torch.ones(2), torch.full((3,), 2.0)])
    assert buffer.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]
