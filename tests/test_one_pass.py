"""The one-pass forms of the residual and of the sum over workers (``Compressor.residual``,
``Compressor.combine``: sparsifiers scatter every worker's entries at once and zero the sent ones;
table decoders decode onto a base) give the general definitions' values:
``compensated - decompress(payload)`` bit for bit, and ``scale * sum(decompress(p))`` bit for bit
at scale 1 and within rounding of the scaling's order otherwise. Selected indices ascend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import grace
from frameworks.torch.ops import TorchOps
from grace import kernels, native
from grace.backends.numpy_ops import NumpyOps
from grace.rng import draw_indices

WORKERS = 3
ONE_ROUND = [name for name in grace.available() if grace.build(name).compressor.rounds == 1]
# numpy has no bfloat16: bf16 runs on torch tensors only.
CASES = [(name, backend) for name in ONE_ROUND for backend in ("numpy", "torch")
         if not (name == "bf16" and backend == "numpy")]


def gradients(backend: str, n: int = 6000):
    rng = np.random.default_rng(7)
    grads = []
    for _ in range(WORKERS):
        x = (rng.standard_normal(n) * 0.1).astype(np.float32)
        x[::97] = 0.0  # exact zeros: sent or not, they must come back as they were
        grads.append(torch.from_numpy(x) if backend == "torch" else x)
    return grads


def payloads(name: str, backend: str):
    ops = TorchOps() if backend == "torch" else NumpyOps()
    compressor = grace.build(name, min_numel=0).compressor
    sent = [compressor.compress(g, "w", ops, rank=r) for r, g in enumerate(gradients(backend))]
    return compressor, ops, sent


def general_sum(compressor, ops, sent, scale):
    ctx = sent[0][1]
    total = compressor.aggregate([compressor.decompress(p, ctx, ops) for p, _ in sent], ops)
    return ops.to_numpy(ops.scale(total, scale) if scale != 1.0 else total)


@pytest.mark.parametrize("name, backend", CASES)
def test_residual_is_compensated_minus_decompressed(name, backend):
    compressor, ops, sent = payloads(name, backend)
    x = gradients(backend)[0]
    payload, ctx = sent[0]
    before = ops.to_numpy(ops.copy(x))
    got = ops.to_numpy(compressor.residual(x, payload, ctx, ops))
    expected = ops.to_numpy(ops.sub(x, compressor.decompress(payload, ctx, ops)))
    np.testing.assert_array_equal(got, expected)
    assert np.array_equal(np.signbit(got), np.signbit(expected))
    np.testing.assert_array_equal(ops.to_numpy(x), before)  # without overwrite, x stays as it was
    # With overwrite (the memory's own compensated tensor), the same residual, where x was.
    overwritten = ops.to_numpy(compressor.residual(ops.copy(x), payload, ctx, ops, overwrite=True))
    np.testing.assert_array_equal(overwritten, expected)


@pytest.mark.parametrize("name, backend", CASES)
def test_combine_is_the_scaled_sum_of_the_decompressed_payloads(name, backend):
    compressor, ops, sent = payloads(name, backend)
    ctx = sent[0][1]
    if compressor.summable:  # allreduce sums the payloads first; combine sees the sum alone
        from grace.rounds import sum_payloads

        workers = [sum_payloads([p for p, _ in sent], ops)]
        sent = [(workers[0], ctx)]
    else:
        workers = [p for p, _ in sent]
    combined = ops.to_numpy(compressor.aggregate_payloads(workers, ctx, ops))
    np.testing.assert_array_equal(combined, general_sum(compressor, ops, sent, 1.0))
    scaled = ops.to_numpy(compressor.aggregate_payloads(workers, ctx, ops, 1.0 / WORKERS))
    expected = general_sum(compressor, ops, sent, 1.0 / WORKERS)
    # Scaling each worker's values before adding them rounds differently from scaling their sum:
    # by a few units in the last place of the terms (not of the sum, where terms cancel).
    terms = sum(np.abs(ops.to_numpy(compressor.decompress(p, ctx, ops))) for p, _ in sent)
    bound = 4 * np.finfo(np.float32).eps * terms / WORKERS
    assert scaled.shape == expected.shape
    assert np.all(np.abs(scaled.astype(np.float64) - expected) <= bound + 1e-38)


@pytest.mark.parametrize("name", ["topk", "dgc", "threshold", "randomk"])
@pytest.mark.parametrize("n", [5000, 300_000])  # the second takes the sampled top-k
def test_sparsifiers_send_ascending_indices_in_every_adapter(name, n):
    import tensorflow as tf

    from frameworks.tensorflow.ops import TensorFlowOps

    rng = np.random.default_rng(3)
    x = rng.standard_normal(n).astype(np.float32)
    found = []
    for ops, tensor in ((NumpyOps(), x), (TorchOps(), torch.from_numpy(x)),
                        (TensorFlowOps(), tf.constant(x))):
        compressor = grace.build(name, min_numel=0).compressor
        payload, ctx = compressor.compress(tensor, "w", ops)
        indices = ops.to_numpy(ctx.data["indices"] if name == "randomk" else payload[1])
        assert np.all(np.diff(indices.astype(np.int64)) > 0), type(ops).__name__
        found.append(indices.astype(np.int64))
    for other in found[1:]:
        np.testing.assert_array_equal(other, found[0])


def test_random_k_draws_ascending_distinct_indices():
    indices = draw_indices(1_000_000, 10_000, 5).astype(np.int64)
    assert len(indices) == 10_000 and np.all(np.diff(indices) > 0)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_powersgd_scales_the_summed_q_not_the_product(backend):
    ops = TorchOps() if backend == "torch" else NumpyOps()
    compressor = grace.build("powersgd", min_numel=0).compressor
    x = gradients(backend, 64 * 90)[0]
    x = x.reshape(64, 90)
    first, ctx = compressor.compress(x, "w", ops)
    (q,) = compressor.second_round(first, ctx, ops)  # one worker: its P is the sum
    expected = ops.to_numpy(ops.scale(compressor.decompress([q], ctx, ops), 0.25))
    got = ops.to_numpy(compressor.aggregate_payloads([[q]], ctx, ops, 0.25))
    assert got.shape == (64, 90)
    np.testing.assert_array_equal(got, expected)  # a power of two scales exactly either way
    third = ops.to_numpy(compressor.aggregate_payloads([[q]], ctx, ops, 1.0 / 3.0))
    scaled = ops.to_numpy(compressor.decompress([q], ctx, ops)) / 3.0
    np.testing.assert_allclose(third, scaled, rtol=1e-5, atol=1e-7 * np.abs(scaled).max())


def test_the_protocols_own_zero_at_is_the_adapters():
    """``Ops.zero_at``'s composite code (what a new adapter gets before it writes its one-pass
    fill) zeroes the same entries as the adapters' fills, repeated indices included, and leaves
    ``x`` as it was."""
    from grace.ops import Ops

    x = np.linspace(-1.0, 1.0, 1000).astype(np.float32)
    indices = np.array([3, 999, 0, 3, 500], np.int32)
    expected = x.copy()
    expected[[3, 999, 0, 500]] = 0.0
    for ops, tensor, idx in ((NumpyOps(), x.copy(), indices),
                             (TorchOps(), torch.from_numpy(x.copy()), torch.from_numpy(indices))):
        composite = ops.to_numpy(Ops.zero_at(ops, tensor, idx))
        np.testing.assert_array_equal(composite, expected)
        np.testing.assert_array_equal(ops.to_numpy(ops.zero_at(tensor, idx)), expected)
        np.testing.assert_array_equal(ops.to_numpy(tensor), x)


@pytest.mark.parametrize("n", [1000, native.CROSSING_MIN_NUMEL + 5])
def test_tensorflows_zero_at_on_either_side_of_the_host_copy(n):
    """TensorFlow zeroes by its scatter below ``CROSSING_MIN_NUMEL`` elements and by one copy on
    the host from there (``native.zeroed_copy``): the same entries, repeated indices included,
    eagerly and traced, ``x`` left as it was."""
    import tensorflow as tf

    from frameworks.tensorflow.ops import TensorFlowOps

    ops = TensorFlowOps()
    x = np.linspace(-1.0, 1.0, n).astype(np.float32)
    indices = np.array([3, n - 1, 0, 3, n // 2], np.int64)
    expected = x.copy()
    expected[indices] = 0.0
    tensor = tf.constant(x)
    np.testing.assert_array_equal(ops.zero_at(tensor, tf.constant(indices)).numpy(), expected)
    traced = tf.function(lambda t, i: ops.zero_at(t, i))
    np.testing.assert_array_equal(traced(tensor, tf.constant(indices)).numpy(), expected)
    np.testing.assert_array_equal(tensor.numpy(), x)
    assert kernels.applies(ops, [tensor]) == (n >= native.CROSSING_MIN_NUMEL)


@pytest.mark.parametrize("make", [grace.topk, grace.randomk])
def test_tensorflows_residual_is_the_sums_buffer_zeroed_after_its_values_are_read(make, monkeypatch):
    """Traced, error feedback's residual is the compensated sum's own buffer with the sent entries
    zeroed in place (``native.zero_in_place``, no copy), and only once the payload has read them:
    the values sent are the sum's, the residual is the sum with zeros where they were, the same
    bits as the copy's, and nothing is copied."""
    import tensorflow as tf

    from frameworks.tensorflow.ops import TensorFlowOps

    ops = TensorFlowOps()
    calls = {"zero_in_place": 0, "zeroed_copy": 0}
    for name in calls:
        def counted(*args, _name=name, _fn=getattr(native, name)):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(native, name, counted)
    n = native.CROSSING_MIN_NUMEL * 2
    rng = np.random.default_rng(0)
    g, r = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    compressor = make(0.01).compressor

    @tf.function
    def step(gradient, residual):
        compensated = ops.add(gradient, residual)
        payload, ctx = compressor.compress(compensated, "w", ops)
        left = compressor.residual(compensated, payload, ctx, ops, overwrite=True)
        return payload[0], compressor.sent_indices(payload, ctx), left

    values, sent, left = (t.numpy() for t in step(tf.constant(g), tf.constant(r)))
    total = g + r
    np.testing.assert_array_equal(values, total[sent])
    assert np.count_nonzero(values) == len(sent) > 0  # read before the zeroing, not after
    expected = total.copy()
    expected[sent] = 0.0
    np.testing.assert_array_equal(left, expected)
    assert calls == {"zero_in_place": 1, "zeroed_copy": 0}
    # The order is the graph's, not the executor's luck: the values are an input of the zeroing.
    graph = step.get_concrete_function(tf.constant(g), tf.constant(r)).graph
    sent_values, _, zeroed = (_through_identities(t) for t in graph.outputs)
    assert sent_values.op in _ancestors(zeroed.op)


def _through_identities(t):
    while t.op.type in ("Identity", "Reshape"):
        t = t.op.inputs[0]
    return t


def _ancestors(op) -> set:
    seen, todo = set(), [op]
    while todo:
        for t in todo.pop().inputs:
            if t.op not in seen:
                seen.add(t.op)
                todo.append(t.op)
    return seen


def test_tensorflow_zeroes_in_place_only_a_sum_of_its_own():
    """With ``overwrite``, an eager tensor (the caller may hold it) and a traced ``Identity`` (its
    input's buffer, a user's gradient) are copied, not zeroed where they are."""
    import tensorflow as tf

    from frameworks.tensorflow.ops import TensorFlowOps

    ops = TensorFlowOps()
    n = native.CROSSING_MIN_NUMEL + 5
    x = np.linspace(1.0, 2.0, n).astype(np.float32)
    indices = tf.constant([0, 7, n - 1])
    expected = x.copy()
    expected[[0, 7, n - 1]] = 0.0
    tensor = tf.constant(x)
    np.testing.assert_array_equal(ops.zero_at(tensor, indices, overwrite=True).numpy(), expected)
    traced = tf.function(lambda t: ops.zero_at(ops.copy(t), indices, overwrite=True))
    np.testing.assert_array_equal(traced(tensor).numpy(), expected)
    np.testing.assert_array_equal(tensor.numpy(), x)


@pytest.mark.parametrize("n, k", [(20, 5), (20, 15), (6, 2)])
def test_random_k_draws_every_subset_alike(n, k):
    """Random-k's draw is a uniform choice without replacement: over 6,000 fixed seeds every
    element is chosen k/n of the time and every pair k(k-1)/(n(n-1)) (each within 5 binomial
    standard deviations), and for 2 of 6 each of the 15 sets about equally often (chi-square with
    14 degrees of freedom below 40, p = 2e-4). ``(20, 15)`` draws the 5 left out instead. The
    seeds are hashed, as the compressors' are (``stable_seed``): the counter adds its index to the
    seed's low word, so seeds 2 apart would give streams one draw apart."""
    import itertools

    from grace.compressor import stable_seed

    draws = 6000
    chosen = np.zeros((draws, n), bool)
    for row in range(draws):
        indices = draw_indices(n, k, stable_seed("draw", row))
        assert indices.size == k and np.all(np.diff(indices.astype(np.int64)) > 0)
        chosen[row, indices] = True
    p = k / n
    assert np.all(np.abs(chosen.sum(0) - draws * p) < 5 * np.sqrt(draws * p * (1 - p)))
    pairs = (chosen[:, :, None] & chosen[:, None, :]).sum(0)[np.triu_indices(n, 1)]
    q = k * (k - 1) / (n * (n - 1))
    assert np.all(np.abs(pairs - draws * q) < 5 * np.sqrt(draws * q * (1 - q)))
    if (n, k) == (6, 2):
        sets = list(itertools.combinations(range(n), k))
        counts = np.zeros(len(sets))
        for row in chosen:
            counts[sets.index(tuple(np.flatnonzero(row)))] += 1
        expected = draws / len(sets)
        assert ((counts - expected) ** 2 / expected).sum() < 40


def test_random_k_draws_refuse_what_they_cannot_draw():
    with pytest.raises(ValueError, match="k must be in"):
        draw_indices(10, 11, 0)
    with pytest.raises(ValueError, match="below 2\\*\\*31"):
        draw_indices(2**31, 10, 0)
