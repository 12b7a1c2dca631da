"""Real workers (``horovodrun -np 2``) training with grace in TensorFlow: DistributedGradientTape eager
and under tf.function, the TF1-style DistributedOptimizer, and Keras 3 ``model.fit``. Weights must
match the numpy models of the algorithms to 1e-5 and be identical on every worker."""

from __future__ import annotations

import json

import numpy as np
import pytest

import grace
from tests import reference
from tests.test_horovod_torch import TOL, assert_steps_alike, check, load
from tests.workers.common import LR

STEPS = 10
TOPK_BYTES = STEPS * (64 * 4 + 64 * 4 + 8 * 4)


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


def test_tape_in_tf_function_twobit_quantizes_with_error_feedback(tf_run):
    infos = check(tf_run, "tape_function_twobit", reference.simulate(reference.twobit_with_residual(1.0)))
    assert infos[0]["stats"]["bytes_sent"] == STEPS * (320 + 3 * 4 + 8 * 4)  # a t per bucket of 512


def test_tape_in_tf_function_twobit_with_an_absolute_threshold(tf_run):
    check(tf_run, "tape_function_twobit_absolute",
          reference.simulate(reference.twobit_with_residual(0.05, relative=False)))


def test_tape_in_tf_function_fp16_with_sum(tf_run):
    # op=hvd.Sum: the workers' gradients are added, not averaged, so each float16 rounding flip
    # counts twice against test_horovod_torch.test_grace_fp16's tolerance of three flips.
    check(tf_run, "tape_function_fp16_sum", reference.simulate(fp16=True, average=False),
          tol=2 * 3 * 0.1 * 2**-10 / 2)


def test_tape_groups_keep_the_result(tf_run):
    """groups only group Horovod's operations: the same weights as without them."""
    check(tf_run, "tape_function_topk_groups", reference.simulate(reference.topk_with_residual(0.05)))


def test_keras_accumulation_combines_once_per_update(tf_run):
    """Keras's gradient_accumulation_steps=2 (Horovod's TF1 optimizer refuses accumulation in eager
    mode): two micro-steps are summed locally, top-k with error feedback compresses the sum once,
    and the workers exchange once per update: 10 exchanges of W and b for 20 micro-steps."""
    infos = check(tf_run, "keras_topk_accumulate2",
                  reference.simulate(reference.topk_with_residual(0.05), passes=2))
    assert infos[0]["stats"]["tensors"] == 2 * STEPS
    assert infos[0]["stats"]["bytes_sent"] == TOPK_BYTES


# communicator="alltoall": a step's bytes per worker (W: 640 elements a shard, top-k 32 of each):
# its shard for the other worker, 32 values and indices, and its owner's shard re-encoded (64: the
# owners keep twice the workers' share), with their two lengths; b dense.
ALLTOALL_BYTES = STEPS * (32 * 8 + (64 * 8 + 2 * 4) + 8 * 4)


@pytest.mark.parametrize("run", ["tape_eager_topk_alltoall", "tape_function_topk_alltoall"])
def test_tape_through_shard_owners_matches_the_two_stage_model(tf_run, run):
    infos = check(tf_run, run, reference.simulate(exchange=reference.two_stage_topk(0.05, 2)))
    assert infos[0]["stats"]["bytes_sent"] == ALLTOALL_BYTES
    assert infos[0]["stats"]["bytes_received"] == STEPS * (32 * 8 + 64 * 8 + 8 * 4)


def test_onebit_through_shard_owners_traced_matches_the_two_stage_model(tf_run):
    """1-bit under tf.function: each shard's signs (80 bytes) and two means per 512 elements (2
    buckets), its owner's two passes of it (with their four parts' lengths); b dense."""
    infos = check(tf_run, "tape_function_onebit_alltoall",
                  reference.simulate(exchange=reference.two_stage_onebit(2)))
    shard = 80 + 2 * 2 * 4
    assert infos[0]["stats"]["bytes_sent"] == STEPS * (shard + 2 * shard + 4 * 4 + 8 * 4)
    assert infos[0]["stats"]["bytes_received"] == STEPS * (shard + 2 * shard + 8 * 4)


def test_keras_through_shard_owners_matches_the_two_stage_model(tf_run):
    """Keras's kernel is W transposed, so its shards cut the transposed gradient."""
    model = reference.two_stage_topk(0.05, 2)
    check(tf_run, "keras_topk_alltoall", reference.simulate(
        exchange=lambda name, step, grads: model(name, step, [g.T for g in grads]).T))


@pytest.mark.parametrize("name, model", [("onebit", reference.onebit_with_residual),
                                         ("twobit", reference.twobit_with_residual)])
def test_keras_kernels_reach_a_layout_sensitive_compressor_in_pytorchs_order(tf_run, name, model):
    """Keras's Dense kernel is W transposed; 1-bit's and two-bit's buckets of 512 must still cut W
    as PyTorch lays it out (frameworks/tensorflow/layout.py), so the run matches the numpy model on
    W. On the kernel as it lies, the buckets would hold other elements: that model ends elsewhere."""
    check(tf_run, f"keras_{name}", reference.simulate(model()))
    as_it_lies = model()
    other_w, _ = reference.simulate(lambda name, rank, step, g: as_it_lies(name, rank, step, g.T).T)
    weights, _ = load(tf_run, f"keras_{name}", 1)
    assert np.abs(weights[0]["w"] - other_w).max() > 100 * TOL


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
    from tests.test_momentum import DENSE_MOMENTUM, M

    infos = check(tf_run, "keras_dgc_momentum", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True), momentum=DENSE_MOMENTUM))
    assert infos[0]["optimizer_momentum"] == 0.0


def test_keras_sgd_momentum_is_taken_over_by_topk(tf_run):
    """Top-k at its defaults under model.fit: Keras's SGD momentum moves into top-k's error
    feedback on the velocity (no masking, unlike DGC), the optimizer steps without it, b travels
    dense with it from the pipeline; said once on rank 0."""
    from tests.test_momentum import DENSE_MOMENTUM, M

    infos = check(tf_run, "keras_topk_momentum", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M), momentum=DENSE_MOMENTUM))
    assert infos[0]["optimizer_momentum"] == 0.0
    said = [line for line in infos[0]["grace_log"] if line.startswith("grace: topk applies")]
    assert len(said) == 1 and "keep_optimizer=True" in said[0] and infos[1]["grace_log"] == []


def test_keras_keep_optimizer_leaves_sgds_momentum_to_keras(tf_run):
    """keep_optimizer=True: Keras's SGD keeps its momentum 0.9 (applied after the exchange, on W
    and b), DGC applies none of its own, and says so; nothing is said of a takeover."""
    from tests.test_momentum import M

    infos = check(tf_run, "keras_dgc_keep_optimizer", reference.simulate(
        reference.with_velocity(reference.largest(0.05), 0.0, mask=True), momentum={"w": M, "b": M}))
    assert infos[0]["optimizer_momentum"] == M
    assert not [line for line in infos[0]["grace_log"] if "SGD's momentum" in line]  # not taken
    (said,) = [line for line in infos[0]["grace_log"] if "keep_optimizer=True" in line]
    assert "applies none of its default momentum (momentum 0.9)" in said


def test_keras_adam_moments_are_taken_over_by_randomk(tf_run):
    """Random-k with Keras's Adam (grace.second_moment): the kernel's update is its error-feedback
    burst divided by the workers' shared second moment (Keras's epsilon), stepped by the learning
    rate by the wrapper; the bias is Adam's, with its beta_1. Both match the numpy model, with
    random-k's draw for the kernel as Keras names and lays it out (W transposed)."""
    infos = [json.loads((tf_run / f"keras_randomk_adam.rank{r}.json").read_text()) for r in range(2)]
    check(tf_run, "keras_randomk_adam", reference.randomk_adam(
        0.05, 3, lr=0.01, eps=1e-7, name=infos[0]["kernel_path"], transposed=True))
    assert [line for line in infos[0]["grace_log"]
            if line.startswith("grace: randomk takes Adam's moments over")]
    assert len(infos[0]["grace_log"]) == 1 and infos[1]["grace_log"] == []
    assert infos[0]["optimizer_beta_1"] == infos[1]["optimizer_beta_1"] == 0.9


@pytest.mark.parametrize("option", ["clipnorm", "loss_scale_factor", "use_ema", "accumulate"])
def test_keras_adam_keeps_its_moments_where_keras_changes_the_updates(tf_run, option):
    """Keras's Adam (epsilon 1e-3) with ``clipnorm`` (1e6: set, clipping nothing), ``loss_scale_factor`` (4),
    ``use_ema`` or ``gradient_accumulation_steps`` (2): random-k does not take Adam's moments over
    (the caution names the setting), and Adam steps every variable, the kernel included, on random-k's
    exchanged gradients: the numpy model of random-k under Adam, with the final weights the moving
    average of the trajectory for ``use_ema`` (Keras's 0.99, the first step's weights taken whole)."""
    name = f"keras_randomk_adam_{option}"
    infos = [json.loads((tf_run / f"{name}.rank{r}.json").read_text()) for r in range(2)]
    (said,) = [line for line in infos[0]["grace_log"] if line.startswith("grace: randomk")]
    setting = "gradient_accumulation_steps" if option == "accumulate" else option
    assert said.startswith(f"grace: randomk with keras Adam ({setting} set: Adam keeps its moments)")
    assert infos[1]["grace_log"] == []
    assert infos[0]["adam_kernel_velocity"] > 0  # Adam stepped the kernel (0 under the takeover)

    # Keras divides the accumulated micro-steps' sum by their count before Adam sees it.
    share = 0.5 if option == "accumulate" else 1.0

    def model(steps):
        draw = reference.randomk_with_residual(0.05, 3)
        return reference.simulate(
            lambda _, rank, step, g: share * draw(infos[0]["kernel_path"], rank, step, g.T).T,
            compress_b=lambda _, rank, step, g: share * g, adam=True, adam_start=0, keras_eps=1e-3,
            steps=steps,
            passes=2 if option == "accumulate" else 1)

    if option == "use_ema":
        average = model(1)
        for steps in range(2, 11):
            average = tuple(0.99 * a + 0.01 * w for a, w in zip(average, model(steps)))
        check(tf_run, name, average)
        assert np.abs(average[0] - model(10)[0]).max() > 1e-3  # the average is not the last step
    else:
        check(tf_run, name, model(10))


def test_horovods_ops_fuse_sums_in_a_graph_only(tf_run):
    """In a traced graph Horovod's TensorFlow ops start each allreduce when its input exists and
    fuse the ready ones, so the pipeline sends large sums alone there (``fuses_sums``; the
    pipeline's side is tests/test_fusion.py); eagerly each op is a Python call, and it joins."""
    info = json.loads((tf_run / "fuses_sums.rank0.json").read_text())
    assert info["traced"] is True and info["eager"] is False


def test_tf1_momentum_is_turned_off_for_randomk(tf_run):
    # (Keras names the tensor dense/kernel and transposes it: random-k's indices would differ from
    # the numpy model's, which draws them for "weight".)
    from tests.test_momentum import DENSE_MOMENTUM

    check(tf_run, "legacy_randomk_momentum", reference.simulate(
        reference.randomk_with_residual(0.05, 3), momentum=DENSE_MOMENTUM))


def test_tf1_momentum_optimizer_is_taken_over_by_dgc(tf_run):
    from tests.test_momentum import DENSE_MOMENTUM, M

    check(tf_run, "legacy_dgc_momentum", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True), momentum=DENSE_MOMENTUM))


def test_a_momentum_given_to_dgc_on_the_tape_applies_to_the_dense_tensors_too(tf_run):
    """``grace.dgc(momentum=0.9)`` on the tape, the optimizer without momentum: W's velocity before
    compression and b's (dense, below ``min_numel``) before the exchange, as the wrappers do with
    the optimizer's momentum taken over (``keras_dgc_momentum``)."""
    from tests.test_momentum import DENSE_MOMENTUM, M

    check(tf_run, "tape_dgc_given", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True), momentum=DENSE_MOMENTUM))


def test_warmup_under_tf_function_switches_from_dense_to_compressed(tf_run):
    """The tape sees no optimizer: DGC applies its own momentum (0.9), as the wrappers apply the
    momentum they take over: the four warm-up steps send W's velocity dense, which compression
    then continues, and b, dense throughout, steps with its velocity too; the switch is chosen
    inside the traced graph."""
    from tests.test_momentum import DENSE_MOMENTUM

    compress = reference.with_velocity(reference.largest(0.05), 0.9, mask=True, dense_steps=4)
    infos = check(tf_run, "tape_function_dgc_warmup", reference.simulate(compress,
                                                                         momentum=DENSE_MOMENTUM))
    assert infos[0]["traces"] == 2  # traced once (plus TensorFlow's variable-creating trace)
    # Four dense exchanges of W and b, then six of W's 64 values and indices and b dense.
    assert infos[0]["stats"]["bytes_sent"] == 4 * (1288 * 4) + 6 * (64 * 8 + 8 * 4)


def test_inceptionn_workers_agree_to_send_dense_inside_tf_function(tf_run):
    """INCEPTIONN's encoded form would not shrink W: inside the traced step the workers agree, and
    all allreduce the dense tensor, whose average is plain SGD's, at exactly the dense bytes."""
    infos = check(tf_run, "tape_function_inceptionn_dense", reference.simulate())
    assert infos[0]["traces"] == 2
    assert infos[0]["stats"]["bytes_sent"] == infos[0]["stats"]["bytes_dense"] == STEPS * 1288 * 4


# --- PyTorch and TensorFlow train alike -----------------------------------------------------------
EXACT_DECISIONS = {"none", "topk", "randomk", "threshold", "dgc", "qsgd", "terngrad", "onebit",
                   "signsgd", "signum", "efsignsgd", "natural", "sketch", "adaq", "twobit"}
ON_A_GRID = {"fp16", "bf16", "u8bit"}
ON_A_GRID_WITH_FEEDBACK = {"inceptionn"}
CATALOGUE_STEP = 0.1  # tests/workers/common.py's LR, which the catalogue runs use but for the signs


@pytest.mark.parametrize("name", grace.available())
def test_pytorch_and_tensorflow_train_alike(gloo_run, tf_run, name):
    """Every compressor's 10 catalogue steps, the memories (error feedback, DGC's masking, momenta),
    the aggregation (the vote) and the pipeline's finish included, end at the same weights in both
    frameworks. The frameworks' gradients differ in their last bits, nothing more: where every
    decision is exact (a selection, a sign, stochastic rounding from the shared counter-based bits)
    the weights agree to 1e-6; where values are rounded to a grid, a gradient on a grid boundary may
    round the other way, so at most 2% of the weights may differ, by at most one grid step of the
    largest gradient (about 5% of 1.2 for u8bit) times the learning rate (0.1): 5e-3; PowerSGD's QR
    runs in each framework's own LAPACK, which test_cross_framework bounds at 1e-5 of the largest
    value for one step: here over 10 steps. INCEPTIONN keeps its rounding error as a residual, so
    a value rounded the other way changes later roundings too: more weights differ, each by at most
    one grid step (2^-10) times the learning rate per step."""
    torch_w = np.load(gloo_run / f"catalogue_{name}.rank0.npz")
    tf_w = np.load(tf_run / f"catalogue_{name}.rank0.npz")
    for key in ("w", "b"):
        a, b = torch_w[key], tf_w[key]
        if name in EXACT_DECISIONS:
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
        elif name in ON_A_GRID:
            off = np.abs(a - b) > 1e-6
            assert off.mean() <= 0.02 and np.abs(a - b).max() <= 5e-3, (off.sum(), np.abs(a - b).max())
        elif name in ON_A_GRID_WITH_FEEDBACK:
            assert np.abs(a - b).max() <= STEPS * CATALOGUE_STEP * 2.0**-10, np.abs(a - b).max()
        else:
            assert name == "powersgd"
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=STEPS * 1e-5 * np.abs(a).max())
    assert EXACT_DECISIONS | ON_A_GRID | ON_A_GRID_WITH_FEEDBACK | {"powersgd"} == set(grace.available())


# --- TF2 loops as Horovod's examples write them: a tape over a Keras 3 model ---------------------
@pytest.mark.parametrize("name", grace.available())
def test_keras_model_tape_with_the_compression_built_in_the_step_trains_as_over_tf_variables(
        tf_run, name):
    """Horovod's TF2 loop (tests/workers/tf_train.py, keras_tape): Keras 3 variables as the tape's
    sources, the compression built inside a tf.function step traced for two values of a Python
    argument, Keras's SGD, hvd.broadcast_variables after the first step. Bit for bit the weights of
    the same compressor's tape over tf.Variables of the same names (catalogue_<name>, itself held
    to the numpy models elsewhere), on both workers, every exchange through the first pipeline."""
    keras_weights, infos = load(tf_run, f"keras_tape_{name}")
    variable_weights, _ = load(tf_run, f"catalogue_{name}")
    for rank in range(2):
        np.testing.assert_array_equal(keras_weights[rank]["w"], variable_weights[0]["w"])
        np.testing.assert_array_equal(keras_weights[rank]["b"], variable_weights[0]["b"])
    w0, _ = reference.init_weights(0)
    assert np.abs(keras_weights[0]["w"] - w0).max() > 100 * TOL
    # Three traces (first_batch True, traced twice as it creates variables, then False), three
    # pipelines built, and the first one's stats count all ten steps' two tensors.
    assert infos[0]["traces"] == 3
    assert infos[0]["stats"]["tensors"] == 2 * STEPS


@pytest.mark.parametrize("compression, tol", [("none", TOL), ("fp16", 3 * 0.1 * 2**-10 / 2)])
def test_horovods_own_tape_over_a_keras_model_averages_with_import_grace(tf_run, compression, tol):
    """Horovod's own compression (no grace pipeline) over Keras 3 variables: Horovod's tape fails on
    Keras 3 (no ref()); with import grace it averages as the numpy model does (fp16: within three
    float16 rounding flips, as test_horovod_torch.test_grace_fp16 explains)."""
    check(tf_run, f"keras_tape_horovod_{compression}", reference.simulate(fp16=compression == "fp16"),
          tol=tol)


def test_two_functions_building_the_same_compression_get_a_pipeline_each(tf_run):
    """Two tf.function steps made by one factory (the same line builds the compression in both)
    over two models whose variables have the same names: each function has its own pipeline
    (residuals, counters), so the first model trains exactly as top-k alone would."""
    check(tf_run, "keras_two_functions", reference.simulate(reference.topk_with_residual(0.05)))
    _, infos = load(tf_run, "keras_two_functions")
    assert infos[0]["tensors"] == [2 * STEPS, 2 * STEPS]


def test_a_keras_model_broadcast_after_the_first_step_gives_every_worker_rank_0s_weights(tf_run):
    """Rank 1 starts 1.0 off; the first step's broadcast (inside tf.function, as Horovod's examples
    do) makes both workers identical, and they stay so."""
    weights, _ = load(tf_run, "keras_tape_topk_broadcast")
    np.testing.assert_array_equal(weights[0]["w"], weights[1]["w"])
    np.testing.assert_array_equal(weights[0]["b"], weights[1]["b"])


def test_broadcast_variables_takes_keras_variables_eagerly_and_in_a_function(tf_run):
    """hvd.broadcast_variables over a Keras 3 model's and optimizer's variables: eagerly (Horovod's
    own fails there) and in tf.function, every worker ends with rank 0's weights and step count."""
    _, infos = load(tf_run, "keras_broadcast")
    w0, b0 = reference.init_weights(0)
    for way in ("eager", "function"):
        for info in infos:
            np.testing.assert_array_equal(np.array(info[way][0], np.float32), w0)
            np.testing.assert_array_equal(np.array(info[way][1], np.float32), b0)
            assert info[way][2] == 5  # rank 0's iterations; rank 1 set 6
            assert info[way][3] == [1.0]  # rank 0's momentum slots (rank 1 set 2.0)


def test_a_keras_variable_registered_as_local_source_keeps_its_own_gradient(tf_run):
    """register_local_source(model.bias) on a Keras 3 variable: its gradient is this worker's own
    divided by the workers' count (scale_local_gradients), the weight's is the average."""
    weights, infos = load(tf_run, "keras_local_source")
    own_w = [np.array(info["own_w"]) for info in infos]
    for rank in range(2):
        np.testing.assert_allclose(weights[rank]["b"], np.array(infos[rank]["own_b"]) / 2,
                                   atol=1e-7, rtol=0)
        np.testing.assert_allclose(weights[rank]["w"], (own_w[0] + own_w[1]) / 2, atol=1e-7, rtol=0)
    assert np.abs(own_w[0] - own_w[1]).max() > 1e-3  # the workers' own gradients do differ


def test_horovods_keras_callbacks_work_on_keras3_with_import_grace(tf_run):
    """tensorflow2_keras_mnist.py's callbacks, mended: the broadcast makes rank 1 (started 1.0 off)
    end with rank 0's weights; the metric average gives both workers the same epoch losses (each
    trains on its own data); the warm-up's rate at each epoch's end is Horovod's schedule,
    LR / 2 * (e * (2 - 1) / 2 + 1) for e = 1, 2, then LR; momentum correction is reported once."""
    weights, infos = load(tf_run, "keras_horovod_callbacks")
    np.testing.assert_array_equal(weights[0]["w"], weights[1]["w"])
    np.testing.assert_array_equal(weights[0]["b"], weights[1]["b"])
    assert infos[0]["loss"] == infos[1]["loss"]
    raw = np.array([info["raw_loss"] for info in infos])
    assert np.abs(raw[0] - raw[1]).max() > 1e-3  # each worker's own loss differs
    np.testing.assert_allclose(infos[0]["loss"], raw.mean(axis=0), rtol=1e-6)
    assert infos[0]["loss"][-1] < infos[0]["loss"][0]
    np.testing.assert_allclose(infos[0]["lr"], [0.75 * LR, LR, LR], rtol=1e-6)
    assert infos[0]["subclass_saw"] == [0, 1, 2]  # a user's subclass overrides the mended method
    said = [line for line in infos[0]["grace_log"] if "momentum correction" in line]
    assert len(said) == 1 and "is not applied on Keras 3" in said[0]
    assert infos[1]["grace_log"] == []  # rank 0 only


def test_a_tape_built_without_compression_stays_horovods(tf_run):
    """hvd.DistributedGradientTape(tape), as Horovod's own scripts build it: Horovod's tape with
    Horovod's defaults (no grace pipeline; Adasum accepted at construction), its average of the
    workers' gradients over the Keras 3 model's variables equal on both workers."""
    weights, infos = load(tf_run, "plain_tape")
    for info in infos:
        assert info["grace_pipeline"] is False and info["adasum_error"] is None
    np.testing.assert_array_equal(weights[0]["w"], weights[1]["w"])
    own = [reference.gradients(*reference.init_weights(0), *reference.batch(r, 0)) for r in range(2)]
    np.testing.assert_allclose(weights[0]["w"], (own[0][0] + own[1][0]) / 2, atol=1e-6, rtol=0)


def test_without_the_mend_horovods_tape_fails_on_keras3_variables(tf_run):
    """GRACE_MEND_HOROVOD=0 leaves Horovod 0.28.1 as it is: its tape cannot key Keras 3 variables
    (the failure the mend exists for; if Horovod fixes it, this test says the mend can go)."""
    _, infos = load(tf_run, "keras_tape_unmended")
    assert infos[0]["error"] == "'Variable' object has no attribute 'ref'"
    assert "'SymbolicTensor' object has no attribute 'assign'" in infos[0]["broadcast_error"]


def test_the_tape_says_once_on_rank_0_that_dgc_applies_its_own_momentum(tf_run):
    """DistributedGradientTape sees no optimizer: DGC's default 0.9 is its own, and an optimizer
    with momentum would apply it twice (docs/quality.md's 0.10-accuracy failure). Said once over
    the step's three traces, on rank 0 only."""
    _, infos = load(tf_run, "tape_dgc_said")
    lines = [line for line in infos[0]["grace_log"] if "DistributedGradientTape sees no" in line]
    assert len(lines) == 1 and "dgc applies its own momentum (momentum 0.9)" in lines[0]
    # Over a Keras model, the mend says so once, and so does the sharing of in-step pipelines.
    assert len([line for line in infos[0]["grace_log"] if "keys its sources by ref()" in line]) == 1
    assert len([line for line in infos[0]["grace_log"] if "built again at each trace" in line]) == 1
    assert infos[1]["grace_log"] == []


def test_keras_fit_says_at_the_first_step_that_a_sign_methods_rate_is_far_too_large(tf_run):
    _, infos = load(tf_run, "keras_signsgd_said")
    (line,) = [line for line in infos[0]["grace_log"] if "times what it needs" in line]
    assert "learning rate 0.05 is 500 times what it needs; use about 0.0001" in line
    # and, as it was built, that its shortfall is its missing error feedback: on rank 0 only
    assert [line for line in infos[0]["grace_log"] if "no error feedback" in line]
    assert infos[1]["grace_log"] == []
