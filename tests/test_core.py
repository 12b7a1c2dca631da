"""Each component's defining property, on the numpy reference backend and the torch adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import grace
from frameworks.torch.ops import TorchOps
from grace.backends import InProcessGroup, NumpyOps
from grace.compressors import FP16, NoneCompressor, RandomK, TopK
from grace.compressors.topk import MIN_KEPT, kept
from grace.memories import ResidualMemory

BACKENDS = {"numpy": lambda a: a, "torch": torch.from_numpy}


def as_numpy(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@pytest.fixture(params=sorted(BACKENDS))
def tensor(request):
    return BACKENDS[request.param]


def test_ops_for_picks_the_framework():
    assert isinstance(grace.ops_for(np.zeros(3)), NumpyOps)
    assert isinstance(grace.ops_for(torch.zeros(3)), TorchOps)
    with pytest.raises(TypeError, match="cannot operate on a builtins.list"):
        grace.ops_for([1.0])


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 1.0])
def test_topk_keeps_exactly_the_k_largest_magnitudes(tensor, ratio):
    x = np.random.default_rng(0).standard_normal((37, 29)).astype(np.float32)
    compressor = TopK(ratio)
    payload, ctx = compressor.compress(tensor(x), "w")
    k = kept(ratio, x.size)
    values, indices = (as_numpy(p) for p in payload)
    assert values.shape == (k,) and indices.dtype == np.int32
    assert len(set(indices.tolist())) == k
    threshold = np.sort(np.abs(x).reshape(-1))[-k]
    assert (np.abs(values) >= threshold).all()
    np.testing.assert_array_equal(values, x.reshape(-1)[indices])
    out = as_numpy(compressor.decompress(payload, ctx))
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = np.where(np.abs(x) >= threshold, x, 0)
    np.testing.assert_array_equal(out, expected)


def test_topk_keeps_at_least_sixteen_entries_of_a_tensor():
    assert MIN_KEPT == 16
    assert TopK(0.01).k(10) == 10 and TopK(0.01).k(50) == 16 and TopK(0.01).k(1000) == 16
    assert TopK(0.01).k(5000) == 50 and TopK(0.001).k(1280) == 16


def test_randomk_keeps_at_least_min_kept_entries_of_a_tensor():
    # The floor bounds a small tensor's delay (numel / k steps between an element's sends) where
    # 1% would wait 100 steps; large tensors keep their ratio.
    assert RandomK(0.01).min_kept == grace.DEFAULT_MIN_NUMEL == 1024  # the dense threshold
    assert RandomK(0.01).k(500) == 500 and RandomK(0.01).k(2560) == 1024
    assert RandomK(0.01).k(102_400) == 1024 and RandomK(0.01).k(400_000) == 4000
    assert RandomK(0.01, min_kept=1).k(2560) == 25 and RandomK(0.01, min_kept=1).k(50) == 1
    with pytest.raises(ValueError, match=r"min_kept must be an int >= 1, got 0"):
        grace.randomk(min_kept=0)


@pytest.mark.parametrize("compressor",
                         [TopK(0.1), RandomK(0.1, seed=5, min_kept=1), FP16(), NoneCompressor()],
                         ids=lambda c: c.name)
def test_residual_memory_keeps_exactly_what_was_not_sent(tensor, compressor):
    rng = np.random.default_rng(1)
    memory = ResidualMemory()
    ops = grace.ops_for(tensor(np.zeros(1, np.float32)))
    previous = np.zeros((20, 30), np.float32)
    for step in range(4):
        g = tensor(rng.standard_normal((20, 30)).astype(np.float32))
        compensated = memory.compensate(g, "w", ops)
        payload, ctx = compressor.compress(compensated, "w", ops)
        memory.update(compensated, "w", compressor, payload, ctx, ops)
        sent = as_numpy(compressor.decompress(payload, ctx, ops))
        residual = as_numpy(memory.residuals["w"])
        # sent + residual == gradient + previous residual (exactly: the sent part is a copy of the
        # compensated entries and the residual is the rest)
        np.testing.assert_array_equal(sent + residual, as_numpy(g) + previous)
        previous = residual


def test_randomk_same_seed_same_indices_private_generator(tensor):
    x = np.arange(1000, dtype=np.float32)
    workers = [RandomK(0.05, seed=7, min_kept=1) for _ in range(2)]
    np.random.seed(123)
    torch.manual_seed(123)
    state_np, state_torch = np.random.get_state()[1].copy(), torch.get_rng_state().clone()
    steps = []
    for step in range(3):
        picked = []
        for w in workers:
            _, ctx = w.compress(tensor(x * (1 + step)), "layer")
            picked.append(as_numpy(ctx.data["indices"]))
        np.testing.assert_array_equal(picked[0], picked[1])
        assert len(set(picked[0].tolist())) == 50
        steps.append(picked[0])
    assert not np.array_equal(steps[0], steps[1])  # fresh indices each step
    _, other = RandomK(0.05, seed=7, min_kept=1).compress(tensor(x), "other_layer")
    assert not np.array_equal(as_numpy(other.data["indices"]), steps[0])
    np.testing.assert_array_equal(np.random.get_state()[1], state_np)  # global RNGs untouched
    assert torch.equal(torch.get_rng_state(), state_torch)


def test_randomk_scaled_is_unbiased():
    # E[numel/k * x_i * 1{i picked}] = x_i. Over 4000 draws of 10 of 100 entries, each entry's
    # estimate has std |x_i| * sqrt((n/k - 1) / 4000) = 0.047 |x_i|; 5 sigma bounds the error.
    x = np.linspace(-1, 1, 100).astype(np.float64)
    compressor = RandomK(0.1, seed=0, scale=True)
    total = np.zeros_like(x)
    draws = 4000
    for _ in range(draws):
        payload, ctx = compressor.compress(x, "x")
        total += compressor.decompress(payload, ctx)
    np.testing.assert_allclose(total / draws, x, atol=5 * 0.047 * np.abs(x).max() + 1e-12)


def test_fp16_round_trip_keeps_dtype_and_halves_bytes(tensor):
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    payload, ctx = FP16().compress(tensor(x), "w")
    assert as_numpy(payload[0]).dtype == np.float16
    out = as_numpy(FP16().decompress(payload, ctx))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, x.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("make", [lambda: TopK(0.07), lambda: RandomK(0.07, seed=1, min_kept=1), FP16,
                                  NoneCompressor], ids=["topk", "randomk", "fp16", "none"])
def test_numpy_reference_agrees_with_torch(make):
    x = np.random.default_rng(3).standard_normal((13, 17)).astype(np.float32)
    p_np, ctx_np = make().compress(x, "w")
    p_t, ctx_t = make().compress(torch.from_numpy(x), "w")
    for a, b in zip(p_np, p_t):
        a, b = np.asarray(a), b.numpy()
        if a.dtype == np.int32:  # top-k indices may come in any order
            order_a, order_b = np.argsort(a), np.argsort(b)
            np.testing.assert_array_equal(a[order_a], b[order_b])
        else:
            np.testing.assert_array_equal(np.sort(a), np.sort(b))
    np.testing.assert_array_equal(make().decompress(p_np, ctx_np),
                                  make().decompress(p_t, ctx_t).numpy())


def run_workers(make_pipeline, grads, average=True):
    """Every worker's pipeline through in-process collectives; returns each worker's result."""
    size = len(grads)
    group = InProcessGroup(size)
    pipelines = [make_pipeline() for _ in range(size)]
    workers = [group.worker(r) for r in range(size)]
    pending = [p.start(g, "w", w) for p, g, w in zip(pipelines, grads, workers)]
    scale = 1.0 / size if average else 1.0
    return [p.finish(pd, w, scale) for p, pd, w in zip(pipelines, pending, workers)], pipelines


@pytest.mark.parametrize("communicator", ["allgather", "broadcast"])
def test_pipeline_average_of_topk_over_workers(communicator):
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(2000).astype(np.float32) for _ in range(3)]
    results, pipelines = run_workers(lambda: grace.topk(0.01, communicator=communicator), grads)
    expected = np.zeros(2000, np.float64)
    for g in grads:
        keep = np.argsort(-np.abs(g))[:20]
        expected[keep] += g[keep]
    for r in results:
        np.testing.assert_allclose(r, expected / 3, rtol=1e-6, atol=1e-7)
    stats = pipelines[0].stats()
    # A broadcast per worker: this worker's payload as root, a tensor of its size into the others'.
    assert stats["bytes_sent"] == 20 * 8 * (3 if communicator == "broadcast" else 1)
    assert stats["bytes_dense"] == 8000


def test_pipeline_randomk_allreduce_equals_allgather():
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    via_reduce, p1 = run_workers(lambda: grace.randomk(0.02, seed=9, min_kept=1), grads)
    via_gather, p2 = run_workers(
        lambda: grace.randomk(0.02, seed=9, min_kept=1, communicator="allgather"), grads)
    np.testing.assert_allclose(via_reduce[0], via_gather[0], rtol=1e-6)
    assert p1[0].stats()["bytes_sent"] == 60 * 4  # values only


def test_small_and_integer_tensors_travel_dense():
    grads = [np.arange(10, dtype=np.float32), np.arange(10, dtype=np.float32) * 3]
    results, pipelines = run_workers(lambda: grace.topk(0.01), grads, average=False)
    np.testing.assert_array_equal(results[0], grads[0] + grads[1])
    assert pipelines[0].stats()["bytes_sent"] == 40
    ints = [np.arange(2000, dtype=np.int64)] * 2
    results, _ = run_workers(lambda: grace.topk(0.01), ints, average=False)
    np.testing.assert_array_equal(results[0], 2 * ints[0])
    assert not grace.topk(0.6).compresses((10_000,), "float32", NumpyOps())  # 2*k*4 > dense bytes


def test_empty_tensor_needs_no_collective():
    pipeline = grace.topk(0.1, min_numel=0)
    group = InProcessGroup(2)
    pending = pipeline.start(np.zeros((0, 3), np.float32), "e", group.worker(0))
    assert not pending.live  # nothing was sent
    assert pipeline.finish(pending, group.worker(0)).shape == (0, 3)
    assert not group._ops


def test_stats_count_allgather_lengths_header():
    from grace.communicators import Allgather

    class VariableTopK(TopK):
        fixed_size = False

    pipeline = grace.Pipeline(VariableTopK(0.1), ResidualMemory(), Allgather(), min_numel=0)
    results, _ = run_workers(lambda: pipeline, [np.ones(200, np.float32)])
    assert pipeline.stats()["bytes_sent"] == 20 * 8 + 8


@pytest.mark.parametrize("found", [None, 0.0])
def test_topk_without_a_momentum_to_take_is_plain_error_feedback_bit_for_bit(found):
    """Top-k's default memory (``momentum``) with no momentum taken over (an optimizer without it,
    Adam, a hook that sees none) sends and keeps exactly what plain error feedback does, step
    after step; with SGD's 0.9 taken over it sends the velocity instead, so it differs."""
    from grace.momentum import OptimizerMomentum

    rng = np.random.default_rng(11)
    steps = [[rng.standard_normal(3000).astype(np.float32) for _ in range(2)] for _ in range(6)]

    def trained(memory, momentum):
        group = InProcessGroup(2)
        pipelines = [grace.topk(0.01, **({"memory": memory} if memory else {})) for _ in range(2)]
        if momentum is not None:
            for p in pipelines:
                p.take_momentum(OptimizerMomentum(momentum))
        workers = [group.worker(r) for r in range(2)]
        out = []
        for grads in steps:
            pending = [p.start(g, "w", w) for p, g, w in zip(pipelines, grads, workers)]
            out.append([p.finish(pd, w, 0.5) for p, pd, w in zip(pipelines, pending, workers)])
        return np.array(out)

    plain = trained("residual", found)
    assert grace.topk(0.01).memory.name == "momentum"
    np.testing.assert_array_equal(trained(None, found), plain)
    # With 0.9 taken over: the numpy model of error feedback on the velocity (k = 30 of 3,000).
    from tests import reference

    model = reference.with_velocity(reference.largest(0.01), 0.9)
    expected = [[0.5 * sum(model("w", r, s, grads[r]) for r in range(2))] * 2
                for s, grads in enumerate(steps)]
    velocity = trained(None, 0.9)
    np.testing.assert_allclose(velocity, np.array(expected), rtol=1e-5, atol=1e-6)
    assert np.abs(velocity - plain).max() > 1e-3
