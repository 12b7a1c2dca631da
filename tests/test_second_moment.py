"""Random-k with Adam's moments taken over (grace.second_moment), on the numpy backend between
simulated workers: the update each worker gets must be the workers' error-feedback burst divided by
the root of their averaged second moment at exactly the drawn entries, written here from the
definition; the state rolls back with a non-finite step and resumes bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import grace
from grace.backends import InProcessGroup
from grace.rng import reference_indices

N, K, EPS = 2000, 100, 1e-8


def taken(**options):
    pipeline = grace.randomk(0.05, seed=1, min_kept=1, **options)
    assert pipeline.take_adam_moments(0.999, EPS) is not None
    return pipeline


def exchange(pipelines, grads):
    group = InProcessGroup(len(pipelines))
    workers = [group.worker(r) for r in range(len(pipelines))]
    pending = [p.start(g, "w", w) for p, g, w in zip(pipelines, grads, workers)]
    return [p.finish(e, w, 1.0 / len(pipelines)) for p, e, w in zip(pipelines, pending, workers)]


def gradients(steps, workers=2, seed=0):
    rng = np.random.default_rng(seed)
    # Elements of different scales, as a layer's are: Adam's division is what evens them out.
    scales = np.exp(rng.uniform(-4, 0, N))
    return [[(rng.standard_normal(N) * scales + 0.3 * scales).astype(np.float32)
             for _ in range(workers)] for _ in range(steps)]


def model(steps_grads, seed=1):
    """The updates, from the definition (float64)."""
    draw = grace.randomk(0.05, seed=seed, min_kept=1).compressor
    workers = len(steps_grads[0])
    residual = [np.zeros(N) for _ in range(workers)]
    local = [np.zeros(N) for _ in range(workers)]
    shared = np.zeros(N)
    updates = []
    for step, grads in enumerate(steps_grads):
        keep = reference_indices(N, K, draw.step_seed("w", step))
        burst, drawn = np.zeros(N), np.zeros(N)
        for r, g in enumerate(grads):
            g = g.astype(np.float64)
            local[r] = 0.999 * local[r] + 0.001 * g * g
            c = g + residual[r]
            burst[keep] += c[keep] / workers
            drawn[keep] += local[r][keep] / (1 - 0.999 ** (step + 1)) / workers
            residual[r] = c
            residual[r][keep] = 0.0
        shared[keep] = drawn[keep]
        updates.append(burst / (np.sqrt(shared) + EPS))
    return updates


def test_the_update_is_the_burst_over_the_workers_shared_second_moment():
    steps = gradients(5)
    pipelines = [taken() for _ in range(2)]
    expected = model(steps)
    for step, grads in enumerate(steps):
        results = exchange(pipelines, grads)
        np.testing.assert_array_equal(results[0], results[1])  # alike on every worker
        np.testing.assert_allclose(results[0], expected[step], rtol=2e-5, atol=1e-6)
        assert np.count_nonzero(results[0]) == K  # only the drawn entries move
    # The drawn entries' second moment travels beside their values: twice random-k's bytes.
    assert pipelines[0].stats()["bytes_sent"] == 5 * 2 * K * 4


def test_a_step_with_a_non_finite_gradient_leaves_the_second_moment_as_it_was():
    steps = gradients(2)
    pipelines = [taken() for _ in range(2)]
    exchange(pipelines, steps[0])
    before = pipelines[0].state_dict()["moments"]
    bad = [steps[1][0], steps[1][1].copy()]
    bad[1][7] = np.nan
    results = exchange(pipelines, bad)
    assert np.isnan(results[0]).all()
    after = pipelines[0].state_dict()["moments"]
    for store in ("local", "weights", "shared"):
        np.testing.assert_array_equal(after[store]["w"], before[store]["w"])


def test_the_second_moment_resumes_bit_for_bit():
    steps = gradients(4)
    first = [taken() for _ in range(2)]
    for grads in steps[:2]:
        exchange(first, grads)
    saved = [p.state_dict() for p in first]
    resumed = [taken() for _ in range(2)]
    for pipeline, state in zip(resumed, saved):
        pipeline.load_state_dict(state)
    for grads in steps[2:]:
        np.testing.assert_array_equal(exchange(first, grads)[0], exchange(resumed, grads)[0])


@pytest.mark.parametrize("make, averaged", [
    (lambda: grace.topk(0.05), True),  # top-k's delays are not one ratio for every element
    (lambda: grace.randomk(0.05, warmup_steps=5), True),  # its dense steps give gradients
    (lambda: grace.randomk(0.05, memory="residual"), True),
    (lambda: grace.randomk(0.05, scale=True, memory="none"), True),
    (lambda: grace.randomk(0.05, granularity="bucket"), True),
    (lambda: grace.randomk(0.05, hierarchical=True), True),
    (lambda: grace.randomk(0.05), False),  # hvd.Sum, or a predivide factor
    (lambda: grace.randomk(0.05, take_adam_moments=False), True),  # the user's choice
])
def test_adams_moments_stay_with_adam_where_the_takeover_does_not_apply(make, averaged):
    pipeline = make()
    assert pipeline.take_adam_moments(0.999, EPS, averaged=averaged) is None
    assert not pipeline.steps_itself((100, 100), "float32", grace.ops.ops_for(np.zeros(1)))
    assert "adam=" not in repr(pipeline)


def test_the_caution_is_said_only_where_the_moments_are_not_taken():
    pipeline = grace.randomk(0.05)
    assert "prefer topk or dgc" in pipeline.adam_caution("torch.optim.Adam")
    pipeline.take_adam_moments(0.999, EPS)
    assert pipeline.adam_caution("torch.optim.Adam") is None
    ops = grace.ops.ops_for(np.zeros(1))
    assert pipeline.steps_itself((100, 100), "float32", ops)
    assert not pipeline.steps_itself((10,), "float32", ops)  # below min_numel: dense, Adam's


@pytest.mark.parametrize("beta2, eps, message", [
    (1.0, EPS, r"beta2 must be in \[0, 1\), got 1.0"),
    (-0.5, EPS, r"beta2 must be in \[0, 1\)"),
    (0.999, -1.0, "eps must be at least 0"),
])
def test_adams_settings_are_checked_where_they_are_taken(beta2, eps, message):
    with pytest.raises(ValueError, match=message):
        grace.randomk(0.05).take_adam_moments(beta2, eps)
