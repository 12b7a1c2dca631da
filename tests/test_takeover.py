"""The optimizer takeovers (grace.takeover) where a user's script does more than step, on real
workers (tests/workers/torch_takeover.py): random-k's Adam takeover through a resume, a loss
scaler's skipped step, ``hvd.broadcast_optimizer_state`` and a learning-rate schedule; SGD's momentum
taken over under ``OneCycleLR`` (which cycles it) and with weight decay. Each against a numpy model
(tests/reference.py) to 1e-5, identical on every worker."""

from __future__ import annotations

import os

import numpy as np
import pytest

from grace.momentum import OptimizerMomentum
from tests import reference
from tests.launch import ROOT, horovodrun
from tests.test_horovod_torch import check
from tests.test_momentum import DENSE_MOMENTUM, info

WORKER = os.path.join(ROOT, "tests", "workers", "torch_takeover.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("takeover")
    return out, horovodrun(WORKER, str(out))


def weights(out, name, rank=0):
    saved = np.load(out / f"{name}.rank{rank}.npz")
    return saved["w"], saved["b"]


def test_randomk_adam_resumes_through_the_optimizers_state_dict(run):
    """Five steps, ``optimizer.state_dict()`` saved, a new model, optimizer and compression loaded
    from it, five more: the model of ten uninterrupted steps. Without the residuals, the workers'
    own second moments, the draws' step counters or Adam's state for b in the checkpoint the last
    five steps would differ (the shared estimate is rewritten wherever a burst arrives, so it alone
    would not)."""
    out, _ = run
    check(out, "adam_resume", reference.randomk_adam(0.05, 3, lr=0.01, eps=1e-8))
    import torch

    saved = torch.load(out / "adam_resume.rank0.pt", weights_only=False)
    assert sorted(saved["optimizer"]["grace"]["moments"]) == ["local", "shared", "weights"]


def test_randomk_adam_steps_by_the_schedulers_learning_rate(run):
    """Under ``LambdaLR`` (1 / (1 + step)) the tensors the wrapper steps (W) and those Adam steps
    (b) both take each step's rate; the model with the first rate throughout is far from it."""
    out, _ = run
    rates = info(out, "adam_scheduled")["rates"]
    assert rates == pytest.approx([0.01 / (1 + s) for s in range(10)])
    check(out, "adam_scheduled", reference.randomk_adam(0.05, 3, lr=rates, eps=1e-8))
    fixed, _ = reference.randomk_adam(0.05, 3, lr=0.01, eps=1e-8)
    assert np.abs(weights(out, "adam_scheduled")[0] - fixed).max() > 1e-3


def test_randomk_adam_after_broadcast_optimizer_state_takes_rank_0s_settings(run):
    """Workers built with learning rates 0.01 and 0.05, then ``hvd.broadcast_optimizer_state``:
    both at 0.01, and the weights are the model's, with b's Adam one step on (the broadcast
    initialises Adam's state with a step of zero gradients, which leaves every weight as it was)."""
    out, _ = run
    for rank in range(2):
        assert info(out, "adam_broadcast", rank)["lr"] == 0.01
        # W is stepped by the wrapper: Adam counted only the broadcast's zero step for it.
        assert info(out, "adam_broadcast", rank)["adam_steps"] == {"weight": 1, "bias": 11}
    check(out, "adam_broadcast", reference.randomk_adam(0.05, 3, lr=0.01, eps=1e-8, adam_start=1))


def test_a_loss_scalers_skipped_step_leaves_randomk_adam_as_if_it_never_came(run):
    """Rank 1's loss is Inf at step 3 under ``GradScaler``: the step is skipped on both workers
    (the weights unchanged there), and the run ends bit for bit where a run that left step 3 out
    ends, so no residual, local or shared second moment, draw or Adam state took it in.

    The documented limit is said too: ``unscale_`` divides what ``.grad`` holds after
    ``synchronize()``, which for the tensors random-k steps itself is their update, not a
    gradient; ``step()`` warns once on every worker to build the compression with
    ``take_adam_moments=False`` (docs/user-guide.md)."""
    out, _ = run
    for rank in range(2):
        assert info(out, "adam_overflow", rank)["unchanged_at_overflow"] is True
        for a, b in zip(weights(out, "adam_overflow", rank), weights(out, "adam_skipped", rank)):
            np.testing.assert_array_equal(a, b)
        for mode in ("overflow", "skipped"):
            (said,) = info(out, f"adam_{mode}", rank)["warnings"]
            assert "unscaled" in said and "take_adam_moments=False" in said
    # The runs trained (two untouched models would match vacuously): b by Adam's steps, W by the
    # wrapper's, each a 1/1,024 of its update there (unscale_ divided them: the warned limit), and
    # the skip mattered: ten steps without one end elsewhere.
    w0, b0 = reference.init_weights(0)
    assert np.abs(weights(out, "adam_skipped")[1] - b0).max() > 1e-2
    assert np.abs(weights(out, "adam_skipped")[0] - w0).max() > 5e-5
    assert np.abs(weights(out, "adam_skipped")[1] - weights(out, "adam_resume")[1]).max() > 1e-4


def test_dgc_follows_one_cycles_momentum_and_learning_rate(run):
    """``OneCycleLR`` cycles SGD's momentum between 0.85 and 0.95 and its rate up and down: DGC
    takes each step's momentum (read before each step), and the optimizer each step's rate. The
    model with the momentum fixed at 0.9 is far from it."""
    out, _ = run
    schedule = info(out, "dgc_one_cycle")
    momenta, rates = schedule["momenta"], schedule["rates"]
    assert min(momenta) == pytest.approx(0.85) and max(momenta) == pytest.approx(0.95)
    assert max(rates) == pytest.approx(0.1) and rates[0] < 0.01
    check(out, "dgc_one_cycle", reference.simulate(
        reference.with_velocity(reference.largest(0.05), momenta, mask=True),
        momentum={"w": 0.0, "b": momenta}, lr=rates))
    fixed, _ = reference.simulate(reference.with_velocity(reference.largest(0.05), 0.9, mask=True),
                                  momentum=DENSE_MOMENTUM, lr=rates)
    assert np.abs(weights(out, "dgc_one_cycle")[0] - fixed).max() > 1e-4


@pytest.mark.parametrize("name, compress", [
    ("dgc_weight_decay", lambda: reference.with_velocity(reference.largest(0.05), 0.9, mask=True)),
    ("randomk_weight_decay", lambda: reference.randomk_with_residual(0.05, 3))])
def test_weight_decay_stays_with_the_optimizer_without_momentum(run, name, compress):
    """SGD(momentum=0.9, weight_decay=0.05) with its momentum taken over: the optimizer adds the
    decay to the exchanged update and steps without momentum, ``p -= lr * (v + decay * p)`` (as in
    DGC's paper), on W and on b (whose momentum the pipeline applied before the exchange)."""
    out, _ = run
    check(out, name, reference.simulate(compress(), momentum=DENSE_MOMENTUM, decay=0.05))
    undecayed, _ = reference.simulate(compress(), momentum=DENSE_MOMENTUM)
    assert np.abs(weights(out, name)[0] - undecayed).max() > 1e-3


def test_an_unscale_of_a_large_sparse_update_is_seen():
    """The check behind the warning, on an update of 2 M elements non-zero at 0.1% of them (as
    random-k's at ratio 0.001): a ``GradScaler``'s fused unscale (which leaves the version counter
    as it was) and a clip's scaling are both seen, a replaced tensor too, an untouched one not."""
    import torch

    from frameworks.torch.momentum import _fingerprint, _same

    generator = torch.Generator().manual_seed(0)
    update = torch.zeros(2_000_000)
    drawn = torch.randperm(update.numel(), generator=generator)[:2_000]
    update[drawn] = torch.randn(2_000, generator=generator)
    given = _fingerprint(update)
    assert _same(given, _fingerprint(update))
    version = update._version
    torch._amp_foreach_non_finite_check_and_unscale_([update], torch.zeros(1), torch.full((1,), 0.5))
    assert update._version == version  # what the version alone missed
    assert not _same(given, _fingerprint(update))
    given = _fingerprint(update)
    update.mul_(0.9)  # clip_grad_norm_'s scaling
    assert not _same(given, _fingerprint(update))
    assert not _same(_fingerprint(update), _fingerprint(update.clone()))


@pytest.mark.parametrize("make, found, dense", [
    # given, over an optimizer without momentum: it stands for the optimizer's, everywhere
    (lambda grace: grace.dgc(momentum=0.9), 0.0, 0.9),
    (lambda grace: grace.onebit(momentum=0.5), 0.0, 0.5),
    (lambda grace: grace.signum(beta=0.9), 0.0, 0.9),
    # no optimizer seen (the tape, a DDP hook): DGC's own 0.9
    (lambda grace: grace.dgc(), None, 0.9),
    # the optimizer's, taken over; random-k takes it to turn it off on what it compresses
    (lambda grace: grace.dgc(), 0.8, 0.8),
    (lambda grace: grace.randomk(), 0.8, 0.8),
    # nothing to take: the optimizer as it is; signum's own beta stays with what it compresses,
    # over an optimizer without momentum and where none is seen alike
    (lambda grace: grace.dgc(), 0.0, None),
    (lambda grace: grace.signum(), 0.0, None),
    (lambda grace: grace.signum(), None, None),
    # Nesterov's look-ahead and dampening travel with it
    (lambda grace: grace.dgc(momentum=0.9, nesterov=True), None, (0.9, True, 0.0)),
    (lambda grace: grace.dgc(), OptimizerMomentum(0.8, dampening=0.1), (0.8, False, 0.1)),
    (lambda grace: grace.topk(), 0.9, (0.9, False, 0.0)),
    (lambda grace: grace.topk(), 0.0, None),
    (lambda grace: grace.topk(), None, None),  # no optimizer seen: nothing given, none applied
    (lambda grace: grace.topk(memory="residual"), 0.9, None),
    (lambda grace: grace.topk(keep_optimizer=True), 0.9, None),
    (lambda grace: grace.dgc(keep_optimizer=True), 0.9, None),
])
def test_the_dense_tensors_and_sparse_rows_get_the_momentum_the_compressed_ones_do(make, found, dense):
    """Which momentum the tensors that travel dense, and sparse gradients' rows, get before the
    exchange (``Takeover.dense_memory``, ``row_velocity``): the one that replaces the optimizer's,
    however it came (given, taken over, or DGC's own where no optimizer is seen), else none."""
    import grace

    pipeline = make(grace)
    if found is not None:
        pipeline.take_momentum(found if isinstance(found, OptimizerMomentum) else OptimizerMomentum(found))
    takeover, rows = pipeline.takeover, pipeline.takeover.row_velocity
    if dense is None:
        assert not takeover.dense_momentum and takeover.dense_memory.stateless
        assert (rows.momentum, rows.nesterov, rows.dampening) == (0.0, False, 0.0)
    else:
        expected = dense if isinstance(dense, tuple) else (dense, False, 0.0)
        memory = takeover.dense_memory
        assert takeover.dense_momentum
        assert (memory.momentum, memory.nesterov, memory.dampening) == expected
        assert (rows.momentum, rows.nesterov, rows.dampening) == expected
