"""Real workers (``horovodrun -np 2``) training with grace in TensorFlow: DistributedGradientTape eager
and under tf.function, the TF1-style DistributedOptimizer, and Keras 3 ``model.fit``. Weights must
match the numpy models of the algorithms to 1e-5 and be identical on every worker."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import reference
from launch import ROOT, horovodrun
from test_horovod_torch import TOL, assert_steps_alike, check

import grace

WORKER = os.path.join(ROOT, "tests", "workers", "tf_train.py")
STEPS = 10
TOPK_BYTES = STEPS * (64 * 4 + 64 * 4 + 8 * 4)


@pytest.fixture(scope="module")
def tf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf")
    horovodrun(WORKER, str(out))
    return out


def test_tape_eager_topk(tf_run):
    infos = check(tf_run, "tape_eager_topk", reference.simulate(reference.topk_with_residual(0.05)))
    assert infos[0]["stats"]["bytes_sent"] == TOPK_BYTES


def test_tape_in_tf_function_keeps_state_across_calls(tf_run):
    infos = check(tf_run, "tape_function_topk", reference.simulate(reference.topk_with_residual(0.05)))
    # Residuals and byte counters are variables updated by every call of the traced graph. The step
    # is traced once, plus the initialisation trace TensorFlow makes of any function that creates
    # variables on its first call; 10 calls do not retrace it.
    assert infos[0]["traces"] == 2
    assert infos[0]["stats"]["bytes_sent"] == TOPK_BYTES
    assert infos[0]["stats"]["tensors"] == 2 * STEPS


def test_tape_in_tf_function_randomk_draws_fresh_indices_every_call(tf_run):
    # The same seeds as in PyTorch: the tensor is named "weight" in both frameworks.
    infos = check(tf_run, "tape_function_randomk",
                  reference.simulate(reference.randomk_with_residual(0.05, 3)))
    assert infos[0]["stats"]["bytes_sent"] == STEPS * (64 * 4 + 8 * 4)


def test_tape_in_tf_function_fp16(tf_run):
    # The float16 rounding-boundary tolerance of test_horovod_torch.test_grace_fp16.
    check(tf_run, "tape_function_fp16_sum", reference.simulate(fp16=True), tol=3 * 0.1 * 2**-10 / 2)


def test_legacy_distributed_optimizer(tf_run):
    check(tf_run, "legacy_topk", reference.simulate(reference.topk_with_residual(0.05)))


def test_keras_fit_with_default_compile_really_averages(tf_run):
    # Rank 1 starts from other weights: BroadcastGlobalVariablesCallback gives it rank 0's.
    infos = check(tf_run, "keras_topk", reference.simulate(reference.topk_with_residual(0.05)))
    assert infos[0]["jit_compile"] is False
    assert infos[0]["stats"]["bytes_sent"] == TOPK_BYTES


def test_horovod_own_keras_optimizer_does_not_average_on_keras3(tf_run):
    """What docs/tensorflow.md states: Horovod 0.28.1's Keras DistributedOptimizer with its own
    compression runs, but each worker applies only its own gradients."""
    for rank in range(2):
        weights = np.load(tf_run / f"keras_horovod_none.rank{rank}.npz")
        alone_w, alone_b = reference.simulate(ranks=[rank])
        np.testing.assert_allclose(weights["w"], alone_w, atol=TOL, rtol=0)
    w0 = np.load(tf_run / "keras_horovod_none.rank0.npz")["w"]
    w1 = np.load(tf_run / "keras_horovod_none.rank1.npz")["w"]
    assert np.abs(w0 - w1).max() > 1e-3
    assert json.loads((tf_run / "keras_horovod_none.rank0.json").read_text())["stats"] is None


@pytest.mark.parametrize("name", grace.available())
def test_every_compressor_steps_alike_on_two_workers(tf_run, name):
    assert_steps_alike(tf_run, name)


# --- the optimizer's momentum taken over (grace.momentum) ----------------------------------------
def test_keras_sgd_momentum_is_taken_over_by_dgc(tf_run):
    from test_momentum import DENSE_MOMENTUM, M

    infos = check(tf_run, "keras_dgc_momentum", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True), momentum=DENSE_MOMENTUM))
    assert infos[0]["optimizer_momentum"] == 0.0


def test_tf1_momentum_is_turned_off_for_randomk(tf_run):
    # (Keras names the tensor dense/kernel and transposes it: random-k's indices would differ from
    # the numpy model's, which draws them for "weight".)
    from test_momentum import DENSE_MOMENTUM

    check(tf_run, "legacy_randomk_momentum", reference.simulate(
        reference.randomk_with_residual(0.05, 3), momentum=DENSE_MOMENTUM))


def test_tf1_momentum_optimizer_is_taken_over_by_dgc(tf_run):
    from test_momentum import DENSE_MOMENTUM, M

    check(tf_run, "legacy_dgc_momentum", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True), momentum=DENSE_MOMENTUM))


def test_warmup_under_tf_function_switches_from_dense_to_compressed(tf_run):
    """The tape sees no optimizer: DGC applies its own momentum (0.9) to W once compression starts,
    and the four warm-up steps are plain dense SGD, chosen inside the traced graph."""
    residuals, velocities = {}, {}

    def compress(name, rank, step, g):
        if step < 4:
            return g
        key = (name, rank)
        u = 0.9 * velocities.get(key, 0.0) + g
        c = residuals.get(key, 0.0) + u
        flat = c.reshape(-1)
        keep = np.argsort(-np.abs(flat), kind="stable")[:64]
        sent = np.zeros_like(flat)
        sent[keep] = flat[keep]
        sent = sent.reshape(c.shape)
        residuals[key] = c - sent
        velocities[key] = np.where(sent != 0, 0.0, u)
        return sent

    infos = check(tf_run, "tape_function_dgc_warmup", reference.simulate(compress))
    assert infos[0]["traces"] == 2  # traced once (plus TensorFlow's variable-creating trace)
    # Four dense exchanges of W and b, then six of W's 64 values and indices and b dense.
    assert infos[0]["stats"]["bytes_sent"] == 4 * (1288 * 4) + 6 * (64 * 8 + 8 * 4)


def test_inceptionn_workers_agree_to_send_dense_inside_tf_function(tf_run):
    """INCEPTIONN's encoded form would not shrink W: inside the traced step the workers agree, and
    all allreduce the dense tensor, whose average is plain SGD's, at exactly the dense bytes."""
    infos = check(tf_run, "tape_function_inceptionn_dense", reference.simulate())
    assert infos[0]["traces"] == 2
    assert infos[0]["stats"]["bytes_sent"] == infos[0]["stats"]["bytes_dense"] == STEPS * 1288 * 4
