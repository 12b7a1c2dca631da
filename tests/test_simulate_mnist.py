"""scripts/studies/simulate_mnist.py trains what it says: simulated workers exchanging through grace's own
pipelines reach the accuracy of the quality benchmark's first epoch, through the shards' owners as
well, and bad settings are refused naming the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch import ROOT

# Minutes long: in `make test-slow` and CI, not in `make test` (Makefile).
pytestmark = pytest.mark.slow

SCRIPT = ["-m", "scripts.studies.simulate_mnist"]  # run from the checkout (cwd=ROOT)


RUNS = {
    "adam": ("--spec", "fp32", "--optimizer", "adam", "--passes", "1"),
    "owners": ("--spec", "topk:ratio=0.01;communicator=alltoall", "--workers", "4", "--passes", "1"),
    "gathered": ("--spec", "topk:ratio=0.01;communicator=allgather", "--workers", "4", "--passes", "1"),
}
# Top-k(0.01) at 4 simulated workers, one pass, seeds 0-4, through the owners minus gathered, in
# points (plain error feedback, top-k's default when measured; the test runs today's): +1.7,
# -1.0, +1.0, -1.3, +1.1 on one machine (owners 0.807, 0.785, 0.818, 0.808, 0.812);
# +3.6, +3.6, -2.1, +1.2, -1.1 on another (owners 0.813, 0.824, 0.790, 0.795, 0.808; gathered
# 0.777, 0.788, 0.811, 0.783, 0.819), whose C loops round differently (-march=native). Ten
# differences: mean +0.7, standard deviation 2.0. What the test guards against is the owners
# doing worse; 5 points below gathered is 2.8 deviations under the mean, beyond every seed on
# either machine, and a run whose owners lost the exchange ends near 0.10 (70 points below).
OWNERS_AT_MOST_BELOW = 5.0


@pytest.fixture(scope="module")
def runs():
    """The simulations at once: each is one single-threaded process."""
    started = {name: subprocess.Popen([sys.executable, *SCRIPT, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})
               for name, args in RUNS.items()}
    done = {}
    for name, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in started.values():
                other.kill()
            raise
        done[name] = (process.returncode, stdout, stderr)
    return done


def result(run):
    returncode, stdout, stderr = run
    assert returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1])


def test_one_pass_of_uncompressed_adam_trains(runs):
    """Fp32 with Adam ends its first pass at 0.859 here (data/quality/randomk-adam-remedies.json),
    as the quality benchmark's real workers do (0.85-0.86). 0.82 leaves room for another machine's
    rounding and still fails a run that did not learn (0.10 is chance)."""
    out = result(runs["adam"])
    assert out["spec"] == "fp32" and out["workers"] == 2 and len(out["accuracy"]) == 1
    assert out["accuracy"][0] >= 0.82


def test_four_workers_train_through_the_shards_owners_as_well_as_gathered(runs):
    """Top-k(0.01) through the owners at 4 workers ends its first pass no more than 5 points
    below the same compressor gathered, same seed and length (seed 0: 0.807 against 0.790 on
    one machine, 0.813 against 0.777 on another; 4 real workers reached 0.797 through the owners,
    data/results/alltoall/mnist-4workers.json): the bound is the seeds' spread above. A run
    whose owners lost the exchange ends near 0.10."""
    owners, gathered = result(runs["owners"]), result(runs["gathered"])
    assert owners["workers"] == gathered["workers"] == 4 and gathered["accuracy"][0] >= 0.75
    below = (gathered["accuracy"][0] - owners["accuracy"][0]) * 100
    assert below <= OWNERS_AT_MOST_BELOW, (owners, gathered)


@pytest.mark.parametrize("args, message", [
    (["--spread", "1.0"], "--spread must be in [0, 1), got 1.0"),
    (["--freeze-variance-after", "0", "--optimizer", "adam"],
     "--freeze-variance-after must be at least 1, got 0"),
    (["--freeze-variance-after", "10"], "--freeze-variance-after freezes Adam's second moment: it needs "
                                        "--optimizer adam"),
    (["--passes", "0"], "--passes must be at least 1, got 0"),
    (["--local-adam"], "--local-adam needs --optimizer adam"),
    (["--local-adam", "--optimizer", "adam", "--spread", "0.9"], "--local-adam needs --optimizer adam, "
                                                               "without --spread"),
    (["--workers", "0"], "--workers must be at least 1, got 0"),
    (["--held", "1.0"], "--held needs a randomk spec, a BETA in [0, 1) (got 1.0)"),
    (["--held", "0.9", "--spec", "topk"], "--held needs a randomk spec"),
    (["--held", "0.9", "--local-adam", "--optimizer", "adam"], "--held needs a randomk spec"),
    (["--optimizer", "lamb"], "argument --optimizer: invalid choice: 'lamb'"),
])
def test_bad_settings_are_refused_naming_the_option(args, message, capsys):
    from scripts.studies import simulate_mnist

    with pytest.raises(SystemExit) as exit_:
        simulate_mnist.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_adams_directions_are_the_steps_torchs_adam_takes():
    """``--local-adam`` exchanges each worker's Adam direction (``AdamMoments``) and steps it at the
    learning rate, and ``FreezableAdam`` steps the same directions: for one worker that must be
    torch.optim.Adam's own step, bias correction included, over several steps of changing gradients
    (float32: within 1e-6 of a step of 1e-3 per element)."""
    import torch

    from scripts.studies import simulate_mnist

    torch.manual_seed(0)
    weights = torch.randn(5, 3)
    mine, theirs = weights.clone(), weights.clone().requires_grad_(True)
    local = simulate_mnist.AdamMoments([mine], beta1=0.9)
    adam = torch.optim.Adam([theirs], lr=1e-3, betas=simulate_mnist.BETAS, eps=simulate_mnist.EPS)
    for _ in range(4):
        grad = torch.randn(5, 3) * torch.rand(5, 3)
        mine -= 1e-3 * local.direction([grad])[0]
        theirs.grad = grad.clone()
        adam.step()
    frozen = torch.nn.Parameter(weights.clone())
    freezable = simulate_mnist.FreezableAdam([frozen], lr=1e-3, beta1=0.9)
    torch.manual_seed(1)
    for _ in range(4):
        frozen.grad = torch.randn(5, 3)
        freezable.step()
    torch.manual_seed(1)
    again = weights.clone().requires_grad_(True)
    reference = torch.optim.Adam([again], lr=1e-3, betas=simulate_mnist.BETAS, eps=simulate_mnist.EPS)
    for _ in range(4):
        again.grad = torch.randn(5, 3)
        reference.step()
    assert local.step_count == 4 and freezable.step_count == 4
    assert torch.allclose(mine, theirs.detach(), rtol=0, atol=1e-6)
    assert torch.allclose(frozen.detach(), again.detach(), rtol=0, atol=1e-6)


def test_the_held_estimate_refreshes_the_drawn_entries_and_keeps_the_rest():
    """``--held BETA`` (EF21's estimate): after each exchange, the entries random-k drew hold the
    workers' averaged momentum and every other entry keeps its value from before; a tensor below
    ``min_numel`` is the averaged momentum in full. Checked over two steps with momentum 0.5 against
    the same arithmetic done here, on random-k's own shared draw (exact: the same float32 sums)."""
    import torch

    from scripts.studies import simulate_mnist

    params = [torch.zeros(4000), torch.zeros(10)]
    pipeline = simulate_mnist.build_pipelines("randomk:min_kept=1", 1)[0]
    estimate = simulate_mnist.HeldEstimate(pipeline, params, workers=2, beta=0.5)
    names = ["weight", "bias"]
    torch.manual_seed(0)
    momenta = [[torch.zeros(4000), torch.zeros(10)] for _ in range(2)]
    expected = [torch.zeros(4000), torch.zeros(10)]
    for step in range(2):
        grads = [[torch.randn(4000), torch.randn(10)] for _ in range(2)]
        for worker, worker_grads in zip(momenta, grads):
            for v, g in zip(worker, worker_grads):
                v.mul_(0.5).add_(g, alpha=0.5)
        mean = [torch.stack([worker[i] for worker in momenta]).mean(0) for i in range(2)]
        chosen = estimate.compressor.indices(4000, 40, "weight", None, simulate_mnist.ops_for(mean[0]),
                                             like=mean[0], step=step, shared=True)
        before = expected[0].clone()
        expected[0][chosen] = mean[0][chosen]
        expected[1] = mean[1].clone()
        out = estimate.exchange(grads, names)
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
        untouched = torch.ones(4000, dtype=torch.bool)
        untouched[chosen] = False
        assert chosen.numel() == 40 and torch.equal(out[0][untouched], before[untouched])
