"""The fast torch paths (frameworks/torch/ops.py) give the answers of the plain ones: the exact top-k,
the same packed bytes, the same decoded values, float64 sums and norms. Sizes are above the
thresholds where the fast paths take over."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import grace
from frameworks.torch import ops as torch_ops
from grace import native, selection
from grace.backends.numpy_ops import NumpyOps

TORCH = torch_ops.TorchOps()
NUMPY = NumpyOps()
N = selection.SAMPLED_TOPK_MIN * 2 + 123  # above every fast-path threshold, not a multiple of 8


def magnitudes(x: torch.Tensor, indices) -> np.ndarray:
    return np.sort(x.abs()[torch.as_tensor(np.asarray(indices)).long()].numpy())


def tf_ops():
    from frameworks.tensorflow.ops import TensorFlowOps

    return TensorFlowOps()


def routes():
    """grace/native's top-k kernel where it is built, and the composite code (``native.disabled``)."""
    return ["kernel", "composite"] if native.available() else ["composite"]


@pytest.mark.parametrize("route", routes())
@pytest.mark.parametrize("kind", ["gaussian", "ties", "spike", "sparse"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_sampled_top_k_is_the_exact_top_k(kind, ratio, route):
    """The selected magnitudes are exactly torch.topk's, the indices distinct, on data where a
    sample misleads: many ties at the threshold, a block of large values the strided sample misses,
    and mostly zeros; by the kernel and by the composite code."""
    with contextlib.nullcontext() if route == "kernel" else native.disabled():
        check_exact_top_k(kind, ratio)


def check_exact_top_k(kind, ratio):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, generator=g)
    if kind == "ties":
        x = torch.round(x * 4) / 4  # a few hundred distinct magnitudes
    elif kind == "spike":
        x[1000:1000 + N // 50] *= 100.0
    elif kind == "sparse":
        x = torch.where(torch.rand(N, generator=g) < 0.002, x, torch.zeros(()))
    k = max(1, int(ratio * N))
    expected = np.sort(torch.topk(x.abs(), k).values.numpy())
    chosen = TORCH.topk_indices(x, k)
    assert chosen.dtype == torch.int32 and chosen.numel() == k
    assert torch.unique(chosen).numel() == k
    np.testing.assert_array_equal(magnitudes(x, chosen), expected)

    import tensorflow as tf

    in_graph = tf.function(lambda t: tf_ops().topk_indices(t, k))(tf.constant(x.numpy())).numpy()
    assert in_graph.dtype == np.int32 and len(np.unique(in_graph)) == k
    np.testing.assert_array_equal(magnitudes(x, in_graph), expected)
    reference = NUMPY.topk_indices(x.numpy(), k)  # the same composite over numpy
    assert reference.dtype == np.int32 and len(np.unique(reference)) == k
    np.testing.assert_array_equal(magnitudes(x, reference), expected)
    if kind in ("gaussian", "spike"):  # distinct magnitudes: one answer, the same indices everywhere
        np.testing.assert_array_equal(chosen.numpy(), in_graph)
        np.testing.assert_array_equal(chosen.numpy(), reference)


def test_a_threshold_that_keeps_too_few_tries_the_next_margin(monkeypatch):
    """A sample that overestimates the threshold (its stride lands on large values only) keeps fewer
    than k candidates at the first margin; the next margin, then the full ranking, still give the
    exact top-k, in every adapter."""
    n = selection.SAMPLED_TOPK_MIN * 4
    stride = n // selection.SAMPLE_SIZE
    x = np.ones(n, np.float32)
    x[::stride] = 10.0  # every sampled element is 10
    k = n // 10  # more than the n / stride 10s: the threshold 10 keeps too few
    tried = []
    original = NumpyOps.indices_at_least

    def counting(self, values, threshold):
        tried.append(float(np.reshape(threshold, -1)[0]))
        return original(self, values, threshold)

    monkeypatch.setattr(NumpyOps, "indices_at_least", counting)
    chosen = selection.exact_top_k.composite(NUMPY, x, k=k)
    assert tried == [10.0, 10.0]  # both margins rank inside the sample's 10s
    assert len(np.unique(chosen)) == k and (x[chosen] == 10.0).sum() == n // stride
    import tensorflow as tf

    with native.disabled():
        for ops, cast in ((TORCH, torch.from_numpy), (tf_ops(), tf.constant)):
            got = np.asarray(ops.topk_indices(cast(x), k))
            assert len(np.unique(got)) == k and (x[got] == 10.0).sum() == n // stride


def lowest_index_top_k(x: np.ndarray, k: int) -> np.ndarray:
    """The reference: by magnitude, ties to the lower index, ascending."""
    order = np.lexsort((np.arange(x.size), -np.abs(x)))
    return np.sort(order[:k])


@pytest.mark.skipif(not native.available(), reason=f"no C compiler: {native.reason()}")
@pytest.mark.parametrize("n", [native.MIN_NUMEL + 5, 1 << 15, N])
def test_the_kernel_breaks_ties_to_the_lower_index(n):
    """Where magnitudes tie at the k-th, grace/native's top-k takes the lowest indices (as
    TensorFlow's top_k does), so its payload is one answer whatever the data: a few hundred
    distinct magnitudes, and all zeros."""
    rng = np.random.default_rng(n)
    x = np.round(rng.standard_normal(n) * 4).astype(np.float32) / 4
    for k in (16, n // 100, n // 10, n // 3):
        np.testing.assert_array_equal(native.topk_indices(x, k), lowest_index_top_k(x, k))
    np.testing.assert_array_equal(native.topk_indices(np.zeros(n, np.float32), n // 100),
                                  np.arange(n // 100))


@pytest.mark.skipif(not native.available(), reason=f"no C compiler: {native.reason()}")
def test_the_kernel_finds_the_top_k_when_its_sample_misleads():
    """The kernel's own strided sample (every ``n >> 14``-th element) all 10s: both margins keep
    too few candidates, and ranking every element still gives the exact top-k. NaN counts as the
    largest magnitude (k distinct indices whatever the step holds: the step is then rolled back)."""
    n = selection.SAMPLED_TOPK_MIN * 4
    x = np.ones(n, np.float32)
    x[:: n >> 14] = 10.0
    x[1::7] = 0.5
    k = n // 10
    np.testing.assert_array_equal(native.topk_indices(x, k), lowest_index_top_k(x, k))
    x[[3, 999, n - 1]] = np.nan
    got = native.topk_indices(x, 100)
    assert len(np.unique(got)) == 100 and {3, 999, n - 1} <= set(got.tolist())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_byte_wise_packing_matches_the_reference(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, N).astype(np.int32)
    packed = TORCH.pack_bits(torch.from_numpy(codes), bits)
    np.testing.assert_array_equal(packed.numpy(), NUMPY.pack_bits(codes, bits))
    np.testing.assert_array_equal(TORCH.unpack_bits(packed, bits, N).numpy(), codes)
    values = rng.standard_normal(1 << bits).astype(np.float32)
    decoded = TORCH.unpack_values(packed, bits, N, torch.from_numpy(values))
    np.testing.assert_array_equal(decoded.numpy(), values[codes])
    import tensorflow as tf

    ops = tf_ops()
    tf_packed = ops.pack_bits(tf.constant(codes), bits)
    np.testing.assert_array_equal(tf_packed.numpy(), packed.numpy())
    np.testing.assert_array_equal(ops.unpack_bits(tf_packed, bits, N).numpy(), codes)
    np.testing.assert_array_equal(ops.unpack_values(tf_packed, bits, N, tf.constant(values)).numpy(),
                                  values[codes])
    bools = codes.astype(bool) if bits == 1 else None
    if bools is not None:  # sign bits are packed straight from a comparison
        np.testing.assert_array_equal(TORCH.pack_bits(torch.from_numpy(bools), 1).numpy(),
                                      NUMPY.pack_bits(bools, 1))


def test_chunked_float64_sum_and_norm():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(torch_ops.WIDE_CHUNK * 3 + 5) * 1e3).astype(np.float32)
    wide = x.astype(np.float64)
    assert TORCH.sum(torch.from_numpy(x)).item() == pytest.approx(float(np.float32(wide.sum())),
                                                                  rel=1e-7)
    norm = TORCH.norm(torch.from_numpy(x)).item()
    assert norm == float(np.float32(np.sqrt(np.dot(wide, wide))))


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "onebit", "terngrad", "qsgd", "signum",
                                  "topk", "randomk", "natural"])
def test_large_tensors_decode_as_the_reference_backend_does(name):
    """A payload made by the torch fast paths decodes to the same floats in torch as in the numpy
    reference backend (which has no fast paths)."""
    x = torch.from_numpy(np.random.default_rng(11).standard_normal(N).astype(np.float32))
    compressor = grace.build(name).compressor
    payload, ctx = compressor.compress(x, "w", TORCH)
    fast = compressor.decompress(payload, ctx, TORCH).numpy()
    reference_ctx = type(ctx)(ctx.shape, ctx.dtype, ctx.numel,
                              {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in ctx.data.items()})
    reference = compressor.decompress([p.numpy() for p in payload], reference_ctx, NUMPY)
    np.testing.assert_array_equal(fast, reference)
