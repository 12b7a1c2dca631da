"""Real workers (``horovodrun -np 2``) training with grace through ``hvd.DistributedOptimizer``: the
trained weights must match the numpy models of the algorithms to 1e-5 and be identical on every
worker."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import grace
from tests import reference
from tests.launch import ROOT, horovodrun
from tests.workers.common import loss

WORKER = os.path.join(ROOT, "tests", "workers", "torch_train.py")
TOL = 1e-5
STEPS_TRAINED = 10  # tests/workers/torch_train.py's steps per scenario


def load(out, name, ranks=2):
    weights = [np.load(out / f"{name}.rank{r}.npz") for r in range(ranks)]
    infos = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(ranks)]
    return weights, infos


def check(out, name, expected, ranks=2, tol=TOL):
    weights, infos = load(out, name, ranks)
    for r in range(1, ranks):  # identical on every worker, bit for bit
        np.testing.assert_array_equal(weights[r]["w"], weights[0]["w"])
        np.testing.assert_array_equal(weights[r]["b"], weights[0]["b"])
    w, b = expected
    np.testing.assert_allclose(weights[0]["w"], w, atol=tol, rtol=0)
    np.testing.assert_allclose(weights[0]["b"], b, atol=tol, rtol=0)
    # The training moved the weights: a vacuous match is ruled out.
    w0, _ = reference.init_weights(0)
    assert np.abs(weights[0]["w"] - w0).max() > 100 * TOL
    return infos


def test_topk_residual_average_matches_numpy_model(gloo_run):
    infos = check(gloo_run, "topk", reference.simulate(reference.topk_with_residual(0.05)))
    assert infos[0]["grace"] and infos[0]["class_module"] == "horovod.torch.optimizer"
    stats = infos[0]["stats"]
    # Per step: W's 64 values + 64 int32 indices; b's 8 floats dense. 10 steps.
    assert stats["bytes_sent"] == 10 * (64 * 4 + 64 * 4 + 8 * 4)
    assert stats["bytes_dense"] == 10 * (1280 * 4 + 8 * 4)


def test_topk_through_shard_owners_matches_the_two_stage_model(gloo_run):
    """communicator="alltoall": shards to their owners, re-encoded there, gathered; error
    feedback on both sides (reference.two_stage_topk)."""
    infos = check(gloo_run, "topk_alltoall",
                  reference.simulate(exchange=reference.two_stage_topk(0.05, 2)))
    # W's shard for the other worker (32 values and indices), then its own shard re-encoded (64:
    # the owners keep twice the workers' share; with its two lengths); b dense. Received: the
    # other worker's shard and the other owner's.
    assert infos[0]["stats"]["bytes_sent"] == 10 * (32 * 8 + 64 * 8 + 2 * 4 + 8 * 4)
    assert infos[0]["stats"]["bytes_received"] == 10 * (32 * 8 + 64 * 8 + 8 * 4)


@pytest.mark.slow  # five real workers on two cores: half a minute (Makefile: test-slow)
def test_auto_goes_through_the_owners_from_five_workers(tmp_path):
    """5 Gloo workers, top-k at its default ``communicator="auto"``: the two-stage model (the
    owners keeping twice the workers' share), not gathering, said once on rank 0; the same top-k
    told to gather matches the gathering model. The route's price here: after 10 steps the owners'
    loss is 1.2% above gathering's (their keeping only ``k``: 3.9%), so it is held within 2%."""
    from tests.workers.common import loss

    log = horovodrun(WORKER, str(tmp_path), "--scenarios", "topk,topk_allgather", np=5)
    owners = reference.simulate(workers=5, exchange=reference.two_stage_topk(0.05, 5))
    gathered = reference.simulate(reference.topk_with_residual(0.05), workers=5)
    check(tmp_path, "topk", owners, ranks=5)
    check(tmp_path, "topk_allgather", gathered, ranks=5)
    said = [line for line in log.splitlines() if "communicator='auto'" in line]
    assert len(said) == 1 and said[0].startswith("[0]") and "5 workers" in said[0], said
    ranks = range(5)
    assert loss(*owners, ranks=ranks) < 1.02 * loss(*gathered, ranks=ranks)
    only_k = reference.simulate(workers=5, exchange=reference.two_stage_topk(0.05, 5, owner_ratio=0.05))
    assert loss(*only_k, ranks=ranks) > 1.02 * loss(*gathered, ranks=ranks)


@pytest.mark.slow  # four real workers on two cores: half a minute (Makefile: test-slow)
def test_four_workers_through_shard_owners(tmp_path):
    """4 Gloo workers: shards of 320 elements, top-k 16 of each, the owners keeping 32; a worker
    receives 2.25 payloads' worth, where gathering would receive three. 1-bit: each shard's signs
    (40 bytes) and two means, the owners' two passes of it (sent with their four parts'
    lengths)."""
    horovodrun(WORKER, str(tmp_path), "--scenarios", "topk_alltoall,onebit_alltoall", np=4)
    infos = check(tmp_path, "topk_alltoall",
                  reference.simulate(workers=4, exchange=reference.two_stage_topk(0.05, 4)), ranks=4)
    assert infos[0]["stats"]["bytes_sent"] == 10 * (3 * 16 * 8 + 32 * 8 + 2 * 4 + 8 * 4)
    assert infos[0]["stats"]["bytes_received"] == 10 * (3 * 16 * 8 + 3 * 32 * 8 + 8 * 4)
    infos = check(tmp_path, "onebit_alltoall",
                  reference.simulate(workers=4, exchange=reference.two_stage_onebit(4)), ranks=4)
    shard, owners = 40 + 2 * 4, 2 * (40 + 2 * 4)
    assert infos[0]["stats"]["bytes_sent"] == 10 * (3 * shard + owners + 4 * 4 + 8 * 4)
    assert infos[0]["stats"]["bytes_received"] == 10 * (3 * shard + 3 * owners + 8 * 4)


def test_topk_with_sum_op(gloo_run):
    check(gloo_run, "topk_sum", reference.simulate(reference.topk_with_residual(0.05), average=False))


def test_topk_through_broadcast_communicator(gloo_run):
    check(gloo_run, "topk_broadcast", reference.simulate(reference.topk_with_residual(0.05)))


def test_randomk_allreduce_shared_indices(gloo_run):
    infos = check(gloo_run, "randomk", reference.simulate(reference.randomk_with_residual(0.05, 3)))
    assert infos[0]["stats"]["bytes_sent"] == 10 * (64 * 4 + 8 * 4)  # values only, no indices


@pytest.mark.parametrize("name, model", [
    ("twobit", lambda: reference.twobit_with_residual(1.0)),
    ("twobit_absolute", lambda: reference.twobit_with_residual(0.05, relative=False))])
def test_twobit_quantizes_to_plus_minus_threshold_with_error_feedback(gloo_run, name, model):
    """Two-bit quantization (MXNet's 2bit) on W, its threshold relative to the root mean square of
    each bucket of 512 elements or absolute, each worker's error kept as its residual; b (8
    elements) travels dense. Per step: W's 1280 codes in 320 bytes (and the relative thresholds of
    its 3 buckets, 12 bytes), b's 32 bytes."""
    infos = check(gloo_run, name, reference.simulate(model()))
    sent = 320 + (3 * 4 if name == "twobit" else 0) + 8 * 4
    assert infos[0]["stats"]["bytes_sent"] == STEPS_TRAINED * sent


def test_grace_fp16(gloo_run):
    # torch computes gradients in float32, the model in float64: an element lying at a float16
    # rounding boundary may round to the neighbouring half value on one side only. The gradients
    # stay below 2 (1.16 at most here), where float16 values are at most 2**-10 apart; one such flip
    # moves a weight by LR * 2**-10 / 2 workers = 4.9e-5. Every element must be within three flips,
    # and all but a few within the usual 1e-5.
    flip = 0.1 * 2**-10 / 2
    infos = check(gloo_run, "fp16", reference.simulate(fp16=True), tol=3 * flip)
    w = np.load(gloo_run / "fp16.rank0.npz")["w"]
    off = np.abs(w - reference.simulate(fp16=True)[0]) > TOL
    assert off.mean() < 0.02, f"{off.sum()} of {off.size} weights differ by more than {TOL}"
    assert infos[0]["stats"]["bytes_sent"] == 10 * (1280 + 8) * 2  # b cast too (min_numel 0)


def test_backward_passes_per_step(gloo_run):
    check(gloo_run, "none_passes2", reference.simulate(passes=2))


def test_groups_start_a_group_together(gloo_run):
    check(gloo_run, "topk_groups", reference.simulate(reference.topk_with_residual(0.05)))


def test_synchronize_then_clip_then_skip_synchronize(gloo_run):
    infos = check(gloo_run, "topk_clip", reference.simulate(reference.topk_with_residual(0.05),
                                                             clip=0.05))
    assert all(info["warnings"] == [] for info in infos)  # the documented way: nothing to say


def test_gradients_changed_while_their_exchange_is_under_way_are_told_once(gloo_run):
    """Clipping between backward and step, without synchronize() first, writes into the
    gradients the exchange took over (error feedback's memory for the next step is there): every
    worker warns once over the run, naming the tensors and the way to do it; the weights still
    move alike on both workers (what the step did is the same everywhere)."""
    weights, infos = load(gloo_run, "topk_clip_early")
    for info in infos:
        assert len(info["warnings"]) == 1, info["warnings"]
        line = info["warnings"][0]
        assert "grace: the gradients of " in line and "weight" in line
        assert "between backward and synchronize()" in line and "skip_synchronize()" in line
        assert "what error feedback keeps for the next step" in line
    np.testing.assert_array_equal(weights[1]["w"], weights[0]["w"])


def test_broadcast_parameters_and_optimizer_state(gloo_run):
    # Workers start from different weights; rank 0's are broadcast, Adam's state is initialised by
    # hvd.broadcast_optimizer_state without any communication through grace.
    infos = check(gloo_run, "none_adam_broadcast", reference.simulate(adam=True))
    assert infos[0]["stats"]["tensors"] == 2 * 10


def test_horovod_own_compression_is_untouched(gloo_run, tmp_path):
    """hvd.Compression.fp16 / .none go through Horovod's own optimizer and give bit-identical weights
    with and without grace imported."""
    horovodrun(WORKER, str(tmp_path), "--import-order", "no-grace")
    for name in ("hvd_fp16", "hvd_none"):
        with_grace, infos = load(gloo_run, name)
        without, _ = load(tmp_path, name)
        assert not infos[0]["grace"]
        for r in range(2):
            np.testing.assert_array_equal(with_grace[r]["w"], without[r]["w"])
            np.testing.assert_array_equal(with_grace[r]["b"], without[r]["b"])
    np.testing.assert_allclose(load(gloo_run, "hvd_none")[0][0]["w"], reference.simulate()[0],
                               atol=TOL, rtol=0)


def test_waiting_for_a_late_worker_sleeps_instead_of_spinning(gloo_run):
    """Horovod's own synchronize spins on sched_yield, taking a core from the workers and threads
    the wait is for; grace's collectives poll and sleep (frameworks.torch.collectives.wait). The
    other worker comes 1 s late: Horovod's wait burns about that second of the waiting thread's
    CPU (a core is free: the other worker sleeps), grace's wait under a tenth of it, ending within
    the 10% (and 1 ms) its naps allow."""
    info = json.loads((gloo_run / "waiting.rank0.json").read_text())
    for way in ("grace", "horovod"):
        assert info[way]["total"] == [3.0] * 4  # 1 + 2
        assert info[way]["wall_s"] > 0.8
    assert info["horovod"]["cpu_s"] > 0.5 * info["horovod"]["wall_s"]  # the method sees a spin
    assert info["grace"]["cpu_s"] < 0.1 * info["grace"]["wall_s"]
    assert info["grace"]["wall_s"] < 1.0 * 1.1 + 0.2


@pytest.mark.parametrize("name", ["forced_threshold", "forced_inceptionn"])
def test_a_gradient_one_worker_skips_does_not_hang_a_voting_compression(gloo_run, name):
    """Rank 0's backward leaves out a layer that rank 1's computes (Horovod's forced allreduce).
    A bucket of threshold or INCEPTIONN starts with a blocking vote: from rank 1's hook it waited
    for rank 0, which waited in synchronize for rank 1 (Horovod's own test_force_allreduce hung).
    They start in synchronize now, in one order: the run ends, the workers equal, the skipped
    layer trained by rank 1's gradient alone."""
    a, b = (np.load(gloo_run / f"{name}.rank{r}.npz") for r in range(2))
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key])
        assert np.isfinite(a[key]).all()
    assert np.abs(a["second.weight"] - a["initial_second"]).max() > 1e-4


DETERMINISM = ["topk", "randomk", "catalogue_qsgd", "catalogue_dgc", "catalogue_natural",
               "catalogue_terngrad", "catalogue_powersgd"]


def test_import_order_horovod_first_and_runs_are_deterministic(gloo_run, tmp_path):
    """A second, independent job (grace imported after Horovod) ends bit-identical to the first,
    stochastic compressors included: the same seeds give the same weights."""
    horovodrun(WORKER, str(tmp_path), "--import-order", "horovod-first", "--scenarios",
               ",".join(DETERMINISM))
    check(tmp_path, "topk", reference.simulate(reference.topk_with_residual(0.05)))
    for name in DETERMINISM:
        first, _ = load(gloo_run, name)
        second, _ = load(tmp_path, name)
        for rank in range(2):
            np.testing.assert_array_equal(first[rank]["w"], second[rank]["w"])
            np.testing.assert_array_equal(first[rank]["b"], second[rank]["b"])


def test_mpi_controller(tmp_path):
    horovodrun(WORKER, str(tmp_path), "--scenarios", "topk,randomk,topk_alltoall", controller="mpi")
    check(tmp_path, "topk", reference.simulate(reference.topk_with_residual(0.05)))
    check(tmp_path, "topk_alltoall", reference.simulate(exchange=reference.two_stage_topk(0.05, 2)))
    check(tmp_path, "randomk", reference.simulate(reference.randomk_with_residual(0.05, 3)))


def assert_steps_alike(run, name):
    """Each compressor with its defaults, 10 steps of the linear model: identical weights on both
    workers, finite, a training loss at least 1% below the start, and the exact dense byte count.
    Whether a compressor trains to convergence is tests/test_convergence.py's (real data, the
    user's momentum SGD) and docs/quality.md's to measure; ten steps cannot show divergence."""
    weights, infos = load(run, f"catalogue_{name}")
    np.testing.assert_array_equal(weights[0]["w"], weights[1]["w"])
    np.testing.assert_array_equal(weights[0]["b"], weights[1]["b"])
    assert np.isfinite(weights[0]["w"]).all()
    w0, b0 = reference.init_weights(0)
    assert loss(weights[0]["w"], weights[0]["b"]) < 0.99 * loss(w0, b0)
    stats = infos[0]["stats"]
    assert stats["tensors"] == 20 and stats["bytes_dense"] == 10 * (1280 + 8) * 4


@pytest.mark.parametrize("name", grace.available())
def test_every_compressor_steps_alike_on_two_workers(gloo_run, name):
    assert_steps_alike(gloo_run, name)


# --- Horovod's semantics, where state in the pipeline could break them -----------------------------
def test_accumulation_before_a_stateful_compressor(gloo_run):
    """backward_passes_per_step=2 sums two backward passes locally, then top-k with error feedback
    compresses the sum once (grace.none() goes through Horovod's own allreduce and cannot show it)."""
    check(gloo_run, "topk_passes2", reference.simulate(reference.topk_with_residual(0.05), passes=2))


def test_groups_and_buckets_start_their_tensors_together(gloo_run):
    """With one group, or a bucket that holds both tensors (both dense; or joined at
    ``granularity="bucket"``), one exchange per step starts once both gradients exist; with a
    bucket per tensor (``bucket_bytes=0``) the first starts as soon as its own gradient does, while
    backward goes on. Results do not depend on the buckets at ``granularity="layer"``."""
    for name in ("topk_groups", "none_bucket", "topk_joined"):
        assert load(gloo_run, name)[1][0]["ready_at_start"] == [2] * 10, name
    assert load(gloo_run, "topk")[1][0]["ready_at_start"] == [1, 2] * 10
    check(gloo_run, "none_bucket", reference.simulate())


def test_bucket_granularity_is_top_k_of_the_joined_tensors(gloo_run):
    """granularity="bucket": top-k and its residual over the bucket's tensors joined into one
    vector (here the bias joins the weight, so both are compressed), against the numpy model."""
    expected = reference.simulate(reference.topk_with_residual(0.05), joined=True)
    infos = check(gloo_run, "topk_joined", expected)
    k = max(16, int(0.05 * (1280 + 8)))
    assert infos[0]["stats"]["tensors"] == 10 * 2
    assert infos[0]["stats"]["bytes_dense"] == 10 * (1280 + 8) * 4
    assert infos[0]["stats"]["bytes_sent"] == 10 * k * (4 + 4)  # float32 values, int32 indices


def test_sum_of_the_vote(gloo_run):
    """op=Sum with signSGD: each step applies the majority vote times the number of workers."""
    w, b = (a.astype(np.float64) for a in reference.init_weights(0))
    for step in range(10):
        grads = [reference.gradients(w.astype(np.float32), b.astype(np.float32),
                                     *reference.batch(r, step)) for r in range(2)]
        votes = np.sign(sum(np.where(gw >= 0, 1.0, -1.0) for gw, _ in grads))
        w = w - 0.002 * 2 * votes
        b = b - 0.002 * sum(gb for _, gb in grads)  # 8 elements: dense, summed
    check(gloo_run, "signsgd_sum", (w, b))


def test_gradient_predivide_factor_keeps_fp16_payloads_in_range(gloo_run):
    """Gradients scaled by 1e5 overflow float16 (65504); divided by 1000 before the cast, they do
    not, and the result is the average (the weights within float16's rounding of 2^-11 of ~200 per
    step, times the learning rate, over 10 steps: 1e-3). Without predivision the run goes to NaN."""
    weights, _ = load(gloo_run, "fp16_predivide")
    expected_w, expected_b = reference.simulate()
    np.testing.assert_allclose(weights[0]["w"], expected_w, atol=1e-3, rtol=0)
    np.testing.assert_allclose(weights[0]["b"], expected_b, atol=1e-3, rtol=0)
    np.testing.assert_array_equal(weights[0]["w"], weights[1]["w"])
    control, _ = load(gloo_run, "fp16_not_predivided")
    assert not np.isfinite(control[0]["w"]).all()


@pytest.mark.slow  # three real workers on two cores: 20 s (Makefile: test-slow)
def test_a_process_set_trains_as_a_job_of_its_size(tmp_path):
    horovodrun(os.path.join(ROOT, "tests", "workers", "torch_process_set.py"), str(tmp_path), np=3)
    expected_w, expected_b = reference.simulate(reference.topk_with_residual(0.05))
    for rank in range(2):
        weights = np.load(tmp_path / f"process_set.rank{rank}.npz")
        np.testing.assert_allclose(weights["w"], expected_w, atol=TOL, rtol=0)
        np.testing.assert_allclose(weights["b"], expected_b, atol=TOL, rtol=0)
    outside = np.load(tmp_path / "process_set.rank2.npz")
    np.testing.assert_array_equal(outside["w"], reference.init_weights(0)[0])
