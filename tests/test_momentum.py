"""The wrapped optimizer's momentum, taken over by the compressors that apply it themselves
(grace.momentum), on real workers: the weights must match numpy models in which the momentum
applies exactly once, to 1e-5, and be identical on every worker."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import grace
from tests import reference
from tests.launch import ROOT, horovodrun
from tests.test_horovod_torch import check, load

WORKER = os.path.join(ROOT, "tests", "workers", "torch_momentum.py")
M = 0.9
DENSE_MOMENTUM = {"w": 0.0, "b": M}  # W's momentum is compressed; b travels dense, with it


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("momentum")
    return out, horovodrun(WORKER, str(out))


def info(out, name, rank=0):
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def test_dgc_takes_sgd_momentum_over_and_applies_it_once(run):
    out, log = run
    check(out, "dgc", reference.simulate(reference.with_velocity(reference.largest(0.05), M, mask=True),
                                         momentum=DENSE_MOMENTUM))
    # The optimizer's settings read as the user set them, before and after its steps (it steps
    # with its momentum set aside).
    assert info(out, "dgc")["momentum"] == info(out, "dgc")["momentum_after"] == M
    assert "momentum=0.9" in info(out, "dgc")["config"]
    # One log line per wrapper built with momentum to take, from rank 0 only.
    lines = [line for line in log.splitlines() if "grace: dgc applies torch.optim.SGD's momentum" in line]
    assert len(lines) == 4 and all(line.startswith("[0]") for line in lines)


def test_a_momentum_given_to_dgc_over_sgd_without_one_trains_as_the_one_taken_over(run):
    """``grace.dgc(momentum=0.9)`` over an SGD without momentum (what a DDP hook's or a tape's user
    is told to write) is the same training as SGD's 0.9 taken over: W's velocity before compression
    and b's, which travels dense (below ``min_numel``), applied before the exchange, bit for bit."""
    out, _ = run
    expected = reference.simulate(reference.with_velocity(reference.largest(0.05), M, mask=True),
                                  momentum=DENSE_MOMENTUM)
    check(out, "dgc_given", expected)
    given, taken = load(out, "dgc_given")[0], load(out, "dgc")[0]
    for r in range(2):
        np.testing.assert_array_equal(given[r]["w"], taken[r]["w"])
        np.testing.assert_array_equal(given[r]["b"], taken[r]["b"])
    # b stepped with the momentum: without it, it ends elsewhere.
    plain_b = reference.simulate(reference.with_velocity(reference.largest(0.05), M, mask=True))[1]
    assert np.abs(given[0]["b"] - plain_b).max() > 1e-3
    assert info(out, "dgc_given")["momentum"] == info(out, "dgc_given")["momentum_after"] == 0.0


def test_broadcast_optimizer_state_gives_every_worker_rank_0s_momentum(run):
    """Workers built with different momenta (0.9 on rank 0, 0.5 on rank 1), then
    hvd.broadcast_optimizer_state: the settings and the compression's momentum are rank 0's on
    both, and the weights are those of momentum 0.9 applied once."""
    out, _ = run
    check(out, "dgc_broadcast", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True), momentum=DENSE_MOMENTUM))
    for rank in range(2):
        assert info(out, "dgc_broadcast", rank)["momentum_after"] == M
        assert "DGCMemory(momentum=0.9," in info(out, "dgc_broadcast", rank)["config_after"]
    assert "DGCMemory(momentum=0.5," in info(out, "dgc_broadcast", 1)["config"]


def test_dgc_with_nesterov(run):
    out, _ = run
    check(out, "dgc_nesterov", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, nesterov=True, mask=True),
        momentum=DENSE_MOMENTUM, nesterov=True))


def test_topk_takes_the_momentum_over_and_compresses_the_velocity(run):
    """Top-k at its defaults (the ``momentum`` memory): SGD's momentum applied before the top-k,
    error feedback on the velocity, the optimizer stepping without it; b, which travels dense,
    gets the momentum from the pipeline. Said once on rank 0, with the opt-out."""
    out, log = run
    check(out, "topk", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M), momentum=DENSE_MOMENTUM))
    # Read as the user set it, before and after its steps (it steps with its momentum set aside).
    assert info(out, "topk")["momentum"] == info(out, "topk")["momentum_after"] == M
    assert "MomentumMemory(momentum=0.9," in info(out, "topk")["config_after"]
    # The two models are apart: the velocity's error feedback is not the residual's.
    assert np.abs(load(out, "topk")[0][0]["w"] - load(out, "topk_residual")[0][0]["w"]).max() > 1e-3
    lines = [line for line in log.splitlines() if "grace: topk applies torch.optim.SGD" in line]
    assert len(lines) == 1 and lines[0].startswith("[0]")
    assert "grace.topk(keep_optimizer=True) leaves it to the optimizer" in lines[0]


def test_randomk_turns_momentum_off_for_its_delayed_updates_only(run):
    out, log = run
    check(out, "randomk", reference.simulate(reference.randomk_with_residual(0.05, 3),
                                             momentum=DENSE_MOMENTUM))
    assert info(out, "randomk")["momentum_after"] == M  # set aside for its steps only
    assert "grace: randomk turns torch.optim.SGD's momentum (0.9) off" in log


@pytest.mark.parametrize("scenario", ["topk_residual", "topk_keep_optimizer"])
def test_plain_error_feedback_or_keep_optimizer_leaves_the_optimizer_alone(run, scenario):
    """``memory="residual"`` owns no momentum, and ``keep_optimizer=True`` takes none: the
    optimizer applies its momentum after the exchange, to W's top-k and to b alike."""
    out, _ = run
    check(out, scenario, reference.simulate(reference.topk_with_residual(0.05),
                                            momentum={"w": M, "b": M}))
    assert info(out, scenario)["momentum"] == info(out, scenario)["momentum_after"] == M


def test_warmup_sends_dense_with_the_momentum_then_compresses_from_the_same_velocity(run):
    out, _ = run
    check(out, "dgc_warmup", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True, dense_steps=4),
        momentum=DENSE_MOMENTUM))


def test_adam_beta1_is_taken_by_signum_and_dgc_only(run):
    """Adam's beta_1 is taken over by DGC and signum (applied before the exchange), not by 1-bit:
    the settings read as the user set them, and the weights match the numpy model of each."""
    out, _ = run
    assert info(out, "signum_adam")["betas_after"] == [0.9, 0.999]  # set aside for its steps only
    assert "Signum(beta=0.9" in info(out, "signum_adam")["config"]
    assert info(out, "dgc_adam")["betas_after"] == [0.9, 0.999]
    assert "momentum=0.9, nesterov=False, dampening=0.9" in info(out, "dgc_adam")["config"]
    assert info(out, "onebit_adam")["betas"] == [0.9, 0.999]
    # Step by step against numpy models (Adam from step 0: no broadcast of its state here). DGC
    # and signum take beta_1 as a dampened momentum, u = 0.9 u + 0.1 g, before the exchange (on W
    # masked where sent, or its sign; on b, dense, as it is), and Adam steps with beta_1 set
    # aside; 1-bit takes nothing: error feedback on the gradient, Adam's beta_1 after the exchange.
    taken = {"adam": True, "beta1": 0.0, "adam_start": 0}
    check(out, "dgc_adam", reference.simulate(
        reference.with_velocity(reference.largest(0.05), M, mask=True, dampening=M),
        **{**taken, "compress_b": reference.velocity(M, M)}))
    check(out, "signum_adam", reference.simulate(
        reference.signs_of_momentum(M), **{**taken, "compress_b": reference.velocity(M, M)}))
    check(out, "onebit_adam", reference.simulate(reference.onebit_with_residual(512), adam=True,
                                                 adam_start=0))


def test_randomk_takes_adams_moments_over_and_steps_its_tensors_itself(run):
    """Random-k with Adam (grace.second_moment): W's update is its error-feedback burst divided by
    the workers' shared second moment, stepped by the learning rate with no first moment; b
    (dense) is Adam's, with its betas as the user set them. Both match the numpy model."""
    out, log = run
    check(out, "randomk_adam", reference.randomk_adam(0.05, 3, lr=0.01, eps=1e-8))
    assert info(out, "randomk_adam")["betas"] == info(out, "randomk_adam")["betas_after"] == [0.9, 0.999]
    assert info(out, "randomk_adam")["stepped_by_optimizer"] == ["bias"]  # Adam skips W
    assert info(out, "randomk_adam")["moments"] == ["local", "shared", "weights"]
    assert "adam=SharedSecondMoment(beta2=0.999, eps=1e-08)" in info(out, "randomk_adam")["config"]
    taken = [line for line in log.splitlines() if "grace: randomk takes Adam's moments over" in line]
    assert len(taken) == 3 and all(line.startswith("[0]") for line in taken)  # adam, adamw, clipped


def test_changing_the_updates_between_synchronize_and_step_is_warned_once(run):
    """With Adam's moments taken over, the compressed tensors' ``.grad`` hold their updates after
    ``synchronize()``: a script that clips there is told, once on each worker, to build the
    compression with take_adam_moments=False; one that does not is told nothing."""
    out, _ = run
    for rank in range(2):
        warned = info(out, "randomk_adam_clipped", rank)["warnings"]
        assert len(warned) == 1 and "take_adam_moments=False" in warned[0]
        assert info(out, "randomk_adam", rank)["warnings"] == []


def test_adamw_decay_is_applied_to_the_tensors_stepped_by_the_wrapper(run):
    """AdamW's decoupled weight decay, ``p -= lr * weight_decay * p`` before the update, applies to
    W (stepped by the wrapper) as to b (by AdamW): both match the numpy model with the decay, and
    differ from it without (ten steps of 1 - 0.01 * 0.5 shrink the weights by about 5%)."""
    out, _ = run
    check(out, "randomk_adamw", reference.randomk_adam(0.05, 3, lr=0.01, eps=1e-8, decay=0.5))
    no_decay, _ = reference.randomk_adam(0.05, 3, lr=0.01, eps=1e-8)
    assert np.abs(np.load(out / "randomk_adamw.rank0.npz")["w"] - no_decay).max() > 1e-3


def test_randomk_with_amsgrad_leaves_adam_alone_and_says_it_falls_short(run):
    """AMSGrad's running maximum is Adam's to keep: nothing is taken, the wrapper says once that
    random-k falls short with Adam, and Adam steps every tensor."""
    out, log = run
    lines = [line for line in log.splitlines() if "grace: randomk with torch.optim.Adam:" in line]
    assert len(lines) == 1 and lines[0].startswith("[0]") and "prefer topk or dgc" in lines[0]
    assert info(out, "randomk_amsgrad")["stepped_by_optimizer"] == ["bias", "weight"]
    assert info(out, "randomk_amsgrad")["moments"] == []
    w0, w1 = (np.load(out / f"randomk_amsgrad.rank{r}.npz")["w"] for r in range(2))
    np.testing.assert_array_equal(w0, w1)


def test_only_the_compressors_measured_short_with_adam_caution_it():
    from grace.registry import COMPRESSORS

    assert grace.randomk().adam_caution("keras Adam").startswith("grace: randomk with keras Adam: ")
    assert grace.topk().adam_caution("keras Adam") is None
    assert [name for name, cls in COMPRESSORS.items() if cls.adam_caution is not None] == ["randomk"]


@pytest.mark.parametrize("name, message", [
    ("conflict", "momentum=0.5 was given to the compression and torch.optim.SGD's momentum is 0.9"),
    ("groups_differ", "SGD's momentum differs between param groups (0.5, 0.9)"),
])
def test_two_momenta_are_refused_at_construction_on_every_worker(run, name, message):
    out, _ = run
    for rank in range(2):
        assert message in info(out, name, rank)["error"]


def test_an_optimizer_without_momentum_is_taken_as_it_is():
    """Over a plain SGD, DGC applies no momentum of its own (the user's optimizer, as it is) and
    logs nothing; signum keeps its beta (its algorithm is a momentum's sign); a momentum given to
    the compression stays as given."""
    from grace.momentum import OptimizerMomentum

    plain = OptimizerMomentum(0.0, source="torch.optim.SGD's momentum")
    dgc = grace.dgc()
    assert dgc.memory.momentum == 0.9  # what the tape, which sees no optimizer, applies
    assert dgc.take_momentum(plain) is None and dgc.memory.momentum == 0.0
    signum = grace.signum()
    assert signum.take_momentum(plain) is None and signum.compressor.momentum == 0.9
    given = grace.dgc(momentum=0.5)
    assert given.take_momentum(plain) is None and given.memory.momentum == 0.5


# --- keep_optimizer=True, and what is said where grace changes what the user set -----------------
def test_keep_optimizer_leaves_dgcs_momentum_to_the_optimizer(run):
    """DGC with keep_optimizer=True: no momentum of its own (error feedback on the gradient, masked
    where sent), and SGD's momentum applied by the optimizer after the exchange, on W and b."""
    out, log = run
    check(out, "dgc_keep_optimizer", reference.simulate(
        reference.with_velocity(reference.largest(0.05), 0.0, mask=True), momentum={"w": M, "b": M}))
    assert "DGCMemory(momentum=0.0," in info(out, "dgc_keep_optimizer")["config"]
    assert info(out, "dgc_keep_optimizer")["momentum"] == M


def test_keep_optimizer_leaves_randomks_momentum_to_the_optimizer(run):
    out, _ = run
    check(out, "randomk_keep_optimizer", reference.simulate(reference.randomk_with_residual(0.05, 3),
                                                            momentum={"w": M, "b": M}))


def test_a_sign_methods_far_too_large_rate_is_said_once_on_rank_0(run):
    out, log = run
    lines = [line for line in log.splitlines() if "grace: signsgd steps each element by +-lr" in line]
    assert len(lines) == 1 and lines[0].startswith("[0]")
    assert "learning rate 0.1 is 1,000 times what it needs" in lines[0]
    # signum: said for signum_adam's Adam at 0.01, not for signum_sgd's 1e-4, the rate it needs.
    (line,) = [line for line in log.splitlines() if "grace: signum steps each element" in line]
    assert "learning rate 0.01 is 100 times what it needs" in line


def test_where_a_compressor_is_measured_short_is_said_once_on_rank_0_at_its_defaults(run):
    """Each compressor built at its defaults whose quality runs miss a target says so once, on
    rank 0, with the line ``Compressor.shortfall_notice`` makes (signum twice built, once said);
    DGC, built here only with another ratio, and top-k, which meets every target, say nothing."""
    from grace.registry import COMPRESSORS

    _, log = run
    for name in ("signsgd", "signum", "onebit"):
        expected = COMPRESSORS[name]().shortfall_notice()
        assert expected is not None
        lines = [line for line in log.splitlines() if f"grace: {name} at its defaults" in line]
        assert len(lines) == 1 and lines[0].startswith("[0]") and expected in lines[0], lines
    for name in ("dgc", "randomk", "topk"):
        assert f"grace: {name} at its defaults" not in log


def test_signum_says_it_keeps_its_beta_over_sgd_without_momentum(run):
    out, log = run
    lines = [line for line in log.splitlines() if "grace: signum applies its own momentum" in line]
    assert len(lines) == 1 and lines[0].startswith("[0]")
    assert "Signum(beta=0.9" in info(out, "signum_sgd")["config"]


def test_the_heap_setting_is_said_once_on_rank_0(run):
    """Every wrapper sets glibc's heap (grace.heap); the job says so once, whatever the count of
    wrappers built (this worker builds over twenty)."""
    _, log = run
    lines = [line for line in log.splitlines() if "glibc's heap now keeps freed memory" in line]
    assert len(lines) == 1 and lines[0].startswith("[0]") and "GRACE_KEEP_FREED_MEMORY=0" in lines[0]
