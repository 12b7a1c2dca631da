"""The defining property of every compressor of the catalogue, on the numpy reference backend and the
torch adapter (the TensorFlow adapter is held to agree with torch in test_cross_framework.py)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import grace
from grace.backends import InProcessGroup
from grace.compressors import CATALOGUE
from grace.compressors import topk as topk_module
from grace.compressors.dgc import WARMUP_RATIOS
from grace.compressors.u8bit import TABLE

BACKENDS = {"numpy": lambda a: a, "torch": torch.from_numpy}
NAMES = sorted(cls.name for cls in CATALOGUE)


def as_numpy(x):
    if isinstance(x, torch.Tensor):
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


@pytest.fixture(params=sorted(BACKENDS))
def tensor(request):
    return BACKENDS[request.param]


def gaussian(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def mean_of_draws(compressor, x, tensor, draws):
    total = np.zeros(x.shape, np.float64)
    for _ in range(draws):
        payload, ctx = compressor.compress(tensor(x), "x")
        total += as_numpy(compressor.decompress(payload, ctx))
    return total / draws


# --- unbiasedness ----------------------------------------------------------------------------------
# Each test averages D = 2000 seeded draws of one tensor and bounds every element's error by 5
# standard deviations of that mean, from the variance the paper proves for the scheme.
DRAWS = 2000


def test_qsgd_is_unbiased(tensor):
    x = gaussian(300, 1)
    s = 3
    mean = mean_of_draws(grace.qsgd(s, block_size=0).compressor, x, tensor, DRAWS)
    # One bucket for the tensor. One element: norm/s times a Bernoulli variable, variance <=
    # (norm/s)^2 / 4.
    bound = 5 * np.linalg.norm(x) / s / 2 / math.sqrt(DRAWS)
    assert np.abs(mean - x).max() < bound


@pytest.mark.parametrize("clip", [2.5, None])
def test_terngrad_is_unbiased_for_the_clipped_gradient(tensor, clip):
    x = gaussian(300, 2)
    x[7] = 9.0  # an outlier that 2.5 root-mean-squares clip
    compressor = grace.terngrad(clip=clip).compressor
    mean = mean_of_draws(compressor, x, tensor, DRAWS)
    rms = np.sqrt(np.mean(x.astype(np.float64) ** 2))
    scale = np.abs(x).max() if clip is None else min(np.abs(x).max(), clip * rms)
    assert (scale < 9.0) == (clip is not None)
    # One element: scale times a Bernoulli variable, variance <= scale^2 / 4.
    bound = 5 * scale / 2 / math.sqrt(DRAWS)
    assert np.abs(mean - np.clip(x, -scale, scale)).max() < bound


def test_qsgd_is_unbiased_per_bucket(tensor):
    x = gaussian(1300, 6)  # three buckets of 512, the last one ragged
    s = 3
    mean = mean_of_draws(grace.qsgd(s, block_size=512).compressor, x, tensor, DRAWS)
    # One element: its bucket's norm / s times a Bernoulli variable, variance <= (norm / s)^2 / 4.
    norms = np.repeat([np.linalg.norm(x[i:i + 512]) for i in range(0, 1300, 512)], 512)[:1300]
    assert np.all(np.abs(mean - x) < 5 * norms / s / 2 / math.sqrt(DRAWS))


def test_natural_compression_is_unbiased_and_within_a_factor_of_two(tensor):
    x = gaussian(300, 3)
    compressor = grace.natural().compressor
    payload, ctx = compressor.compress(tensor(x), "x")
    once = as_numpy(compressor.decompress(payload, ctx))
    ratio = once / x
    assert ((ratio >= 0.5) & (ratio <= 2.0)).all()
    assert np.all(np.log2(np.abs(once)) == np.round(np.log2(np.abs(once))))  # powers of two
    mean = mean_of_draws(compressor, x, tensor, DRAWS)
    # One element: 2^e times a Bernoulli variable, 2^e <= |x|, variance <= |x|^2 / 4.
    assert (np.abs(mean - x) < 5 * np.abs(x) / 2 / math.sqrt(DRAWS)).all()


def test_workers_draw_independently():
    x = gaussian(500, 4)
    compressor = grace.qsgd(1).compressor
    payload0, _ = compressor.compress(x, "x", rank=0)
    payload1, _ = grace.qsgd(1).compressor.compress(x, "x", rank=1)
    assert payload0[1].tobytes() != payload1[1].tobytes()


# --- exactness and error bounds -------------------------------------------------------------------
@pytest.mark.parametrize("warmup", [0, 3])
def test_dgc_sends_exactly_the_top_k_and_warms_up(tensor, warmup):
    pipeline = grace.dgc(0.01, sparsity_warmup_steps=warmup, memory="none", sample_ratio=0.05)
    compressor = pipeline.compressor
    x = gaussian(20_000, 5)
    expected_ratios = ([0.25] * 3 + [0.0625] * 3 + [0.015625] * 3 + [0.01] * 3) if warmup else [0.01] * 12
    for step, ratio in enumerate(expected_ratios):
        assert compressor.ratio_at(step) == ratio
        payload, ctx = compressor.compress(tensor(x * (1 + step)), "w")
        values, indices = (as_numpy(p) for p in payload)
        k = int(ratio * x.size)
        assert values.shape == (k,) and len(set(indices.tolist())) == k
        assert set(indices.tolist()) == set(np.argsort(-np.abs(x))[:k].tolist())
    assert WARMUP_RATIOS == (0.25, 0.0625, 0.015625, 0.004, 0.001)


def test_dgc_memory_momentum_correction_and_masking(monkeypatch):
    monkeypatch.setattr(topk_module, "MIN_KEPT", 1)  # k = 1 of 4: the masking worked by hand
    pipeline = grace.dgc(0.25, momentum=0.5)
    memory, compressor = pipeline.memory, pipeline.compressor
    from grace.backends import NumpyOps
    ops = NumpyOps()
    g1 = np.array([4.0, 1.0, -2.0, 0.5], np.float32)
    v = memory.compensate(g1, "w", ops)             # u = g1, v = u
    np.testing.assert_array_equal(v, g1)
    payload, ctx = compressor.compress(v, "w", ops)  # k = 1: sends 4.0
    memory.update(v, "w", compressor, payload, ctx, ops)
    np.testing.assert_array_equal(memory.residuals["w"], [0.0, 1.0, -2.0, 0.5])
    np.testing.assert_array_equal(memory.velocities["w"], [0.0, 1.0, -2.0, 0.5])  # masked at 0
    g2 = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
    v = memory.compensate(g2, "w", ops)             # u = 0.5 u + g2; v = v + u
    np.testing.assert_array_equal(memory.velocities["w"], [1.0, 1.5, 0.0, 1.25])
    np.testing.assert_array_equal(v, [1.0, 2.5, -2.0, 1.75])


def test_dgc_local_gradient_clipping():
    from grace.backends import NumpyOps
    memory = grace.dgc(0.5, clip_norm=1.0).memory
    v = memory.compensate(np.array([3.0, 4.0], np.float32), "w", NumpyOps())
    np.testing.assert_allclose(v, [0.6, 0.8], rtol=1e-6)


def test_u8bit_relative_error_bound(tensor):
    x = gaussian(5000, 6)
    compressor = grace.u8bit().compressor
    payload, ctx = compressor.compress(tensor(x), "x")
    assert as_numpy(payload[1]).dtype == np.uint8 and as_numpy(payload[1]).size == x.size
    out = as_numpy(compressor.decompress(payload, ctx))
    scale = np.abs(x).max()
    representable = np.abs(x) >= TABLE[1] * scale
    relative = np.abs(out - x)[representable] / np.abs(x)[representable]
    assert relative.max() <= 2 ** (1 / 16) - 1 + 1e-6
    assert np.abs(out - x)[~representable].max(initial=0) <= TABLE[1] * scale
    assert np.abs(out).max() == pytest.approx(scale)


def test_sketch_error_within_bucket_width(tensor):
    x = gaussian(4096, 7)
    compressor = grace.sketch(16).compressor
    payload, ctx = compressor.compress(tensor(x), "x")
    out = as_numpy(compressor.decompress(payload, ctx))
    assert len(np.unique(out)) <= 16
    ordered = np.sort(x)
    edges = ordered[[(i * x.size) // 16 for i in range(16)] + [x.size - 1]]
    width = np.diff(edges).max()
    assert np.abs(out - x)[np.abs(x) < 1.5].max() <= width + 1e-6  # inner buckets
    assert abs(out.mean() - x.mean()) < 1e-5  # bucket means preserve the sum


def test_inceptionn_error_bound_and_classes(tensor):
    x = np.concatenate([gaussian(1000, 8) * 1e-4, gaussian(1000, 9) * 0.05, gaussian(1000, 10) * 5,
                        np.array([100.0, -300.0], np.float32)])
    bound = 2.0**-10
    compressor = grace.inceptionn(bound).compressor
    payload, ctx = compressor.compress(tensor(x), "x")
    tags, small, medium, large = (as_numpy(p) for p in payload)
    out = as_numpy(compressor.decompress(payload, ctx))
    assert np.abs(out - x).max() <= bound / 2 + 1e-7
    assert small.dtype == np.int8 and medium.dtype == np.int16 and large.size == 2
    np.testing.assert_array_equal(out[-2:], x[-2:])  # 32-bit class is exact
    assert sum(p.nbytes for p in (tags, small, medium, large)) < x.nbytes


def test_threshold_sends_what_passes(tensor):
    x = gaussian(1000, 11)
    compressor = grace.threshold(2.0).compressor
    payload, ctx = compressor.compress(tensor(x), "x")
    values, indices = (as_numpy(p) for p in payload)
    np.testing.assert_array_equal(np.sort(indices), np.flatnonzero(np.abs(x) >= 2.0))
    np.testing.assert_array_equal(as_numpy(compressor.decompress(payload, ctx)),
                                  np.where(np.abs(x) >= 2.0, x, 0))


@pytest.mark.parametrize("threshold, dense", [(2.0, False), (0.001, True)])
def test_threshold_workers_agree_on_dense_where_a_payload_would_not_shrink(threshold, dense):
    """Nearly everything passes 0.001 on every worker: all send the tensor dense, at exactly its
    bytes; at 2.0 the sparse payloads (lengths included) are smaller, and sent."""
    grads = [gaussian(2000, 11 + r) for r in range(2)]
    group = InProcessGroup(2)
    pipelines = [grace.threshold(threshold) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:  # the agreement waits for both workers, as processes would
        results = list(pool.map(lambda r: pipelines[r].reduce(grads[r], "x", group.worker(r), 0.5),
                                range(2)))
    stats = pipelines[0].stats()
    if dense:
        assert stats["bytes_sent"] == stats["bytes_dense"] == 8000
        np.testing.assert_allclose(results[0], (grads[0] + grads[1]) / 2, rtol=1e-6)
    else:
        passing = int((np.abs(grads[0]) >= 2.0).sum())
        assert stats["bytes_sent"] == passing * 8 + 8 < 8000
    assert stats["bytes_control"] == 8  # the non-finite flag and the vote on the form


def per_bucket(x, size=512):
    """The 512-element buckets of the 1-d ``x`` (the last one shorter)."""
    return [slice(i, min(i + size, x.size)) for i in range(0, x.size, size)]


def test_onebit_sends_signs_and_two_means_per_bucket(tensor):
    x = gaussian(1300, 12)  # three buckets, the last one ragged
    compressor = grace.onebit().compressor
    payload, ctx = compressor.compress(tensor(x), "x")
    assert as_numpy(payload[0]).shape == (6,)  # a mean of each sign for each of 3 buckets
    out = as_numpy(compressor.decompress(payload, ctx))
    for b in per_bucket(x):
        xb, ob = x[b], out[b]
        np.testing.assert_allclose(ob[xb >= 0], xb[xb >= 0].mean(), rtol=1e-5)
        np.testing.assert_allclose(ob[xb < 0], xb[xb < 0].mean(), rtol=1e-5)
    whole = grace.onebit(block_size=0).compressor  # the paper's two means for the whole tensor
    out = as_numpy(whole.decompress(*whole.compress(tensor(x), "x")))
    np.testing.assert_allclose(out[x >= 0], x[x >= 0].mean(), rtol=1e-5)
    np.testing.assert_allclose(out[x < 0], x[x < 0].mean(), rtol=1e-5)


def test_efsignsgd_scaled_sign_per_bucket(tensor):
    x = gaussian(1300, 13)
    compressor = grace.efsignsgd().compressor
    out = as_numpy(compressor.decompress(*compressor.compress(tensor(x), "x")))
    for b in per_bucket(x):
        np.testing.assert_allclose(out[b], np.where(x[b] >= 0, 1, -1) * np.abs(x[b]).mean(), rtol=1e-5)
    whole = grace.efsignsgd(block_size=0).compressor
    out = as_numpy(whole.decompress(*whole.compress(tensor(x), "x")))
    np.testing.assert_allclose(out, np.where(x >= 0, 1, -1) * np.abs(x).mean(), rtol=1e-5)


def test_twobit_codes_are_mxnets_sixteen_to_a_32_bit_word(tensor):
    """MXNet's 2bit codes, least significant first: 11 for at or above +t, 10 for at or below -t,
    00 otherwise; 16 elements in 4 bytes. Absolute t = 0.5 here (MXNet's)."""
    x = np.array([0.5, -0.5, 0.49, -0.49, 2.0, -3.0, 0.0, 0.1] * 2, np.float32)
    payload, ctx = grace.twobit(0.5, relative=False).compressor.compress(tensor(x), "w")
    (packed,) = [as_numpy(p) for p in payload]
    assert packed.dtype == np.uint8 and packed.size == 4
    codes = [(int(byte) >> shift) & 3 for byte in packed for shift in (0, 2, 4, 6)]
    assert codes == [0b11, 0b10, 0b00, 0b00, 0b11, 0b10, 0b00, 0b00] * 2
    out = as_numpy(grace.twobit(0.5, relative=False).compressor.decompress(payload, ctx))
    np.testing.assert_array_equal(out, np.where(x >= 0.5, 0.5, np.where(x <= -0.5, -0.5, 0.0)))


def test_twobit_codes_an_all_zero_tensor_as_zeros(tensor):
    """An all-zero tensor's relative threshold is 0: every element is at or above it (11), none
    below -0 (no 10, and no code outside [0, 4) spilling into its neighbour), all decoded 0."""
    x = np.zeros(16, np.float32)
    payload, ctx = grace.twobit().compressor.compress(tensor(x), "w")
    t, packed = (as_numpy(p) for p in payload)
    assert t[0] == 0.0 and list(packed) == [0xFF] * 4
    assert not as_numpy(grace.twobit().compressor.decompress(payload, ctx)).any()


def test_twobit_relative_threshold_is_a_multiple_of_the_root_mean_square(tensor):
    """block_size=0: one t for the whole tensor."""
    x = gaussian(1000, 5)
    payload, ctx = grace.twobit(1.5, block_size=0).compressor.compress(tensor(x), "w")
    t = 1.5 * float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    assert as_numpy(payload[0])[0] == pytest.approx(t, rel=1e-6)
    out = as_numpy(grace.twobit(1.5, block_size=0).compressor.decompress(payload, ctx))
    far = np.abs(np.abs(x) - t) > 1e-5 * t
    expected = np.where(x >= t, t, np.where(x <= -t, -t, 0.0))
    np.testing.assert_allclose(out[far], expected[far], rtol=1e-6)


@pytest.mark.parametrize("numel,block_size", [(1000, 512), (1000, 300), (7, 4), (512, 512)])
def test_twobit_relative_threshold_per_bucket_is_each_buckets_root_mean_square(tensor, numel, block_size):
    """One t per bucket of consecutive elements: threshold x that bucket's root mean square (the
    last bucket's over its own elements, not the padding). Buckets of very different scales, so a
    single t for the tensor would send a different set of elements."""
    x = gaussian(numel, 6) * np.repeat(np.float32([1.0, 100.0, 0.01, 3.0]), -(-numel // 4))[:numel]
    c = grace.twobit(1.5, block_size=block_size).compressor
    payload, ctx = c.compress(tensor(x), "w")
    ts, packed = (as_numpy(p) for p in payload)
    starts = range(0, numel, block_size)
    expected_t = [1.5 * float(np.sqrt(np.mean(x[i:i + block_size].astype(np.float64) ** 2))) for i in starts]
    np.testing.assert_allclose(ts, expected_t, rtol=1e-6)
    assert packed.nbytes == math.ceil(numel * 2 / 8)
    assert c.payload_nbytes((numel,), 4) == ts.nbytes + packed.nbytes
    out = as_numpy(c.decompress(payload, ctx))
    t = np.repeat(np.float32(expected_t), block_size)[:numel]
    far = np.abs(np.abs(x) - t) > 1e-5 * t
    expected = np.where(x >= t, t, np.where(x <= -t, -t, 0.0))
    np.testing.assert_allclose(out[far], expected[far], rtol=1e-6)
    whole = grace.twobit(1.5, block_size=0).compressor
    one_t = as_numpy(whole.decompress(*whole.compress(tensor(x), "w")))
    assert len(ts) == 1 or not np.array_equal(one_t != 0, out != 0)


def test_twobit_codes_an_all_zero_bucket_as_zeros_beside_a_non_zero_one(tensor):
    """A bucket of zeros has t = 0 (every element 11, decoded 0); the next bucket keeps its own t."""
    x = np.concatenate([np.zeros(512, np.float32), gaussian(300, 1)])
    c = grace.twobit().compressor
    payload, ctx = c.compress(tensor(x), "w")
    ts, packed = (as_numpy(p) for p in payload)
    assert ts[0] == 0.0 and ts[1] == pytest.approx(float(np.sqrt(np.mean(x[512:].astype(np.float64) ** 2))),
                                                   rel=1e-6)
    assert list(packed[:128]) == [0xFF] * 128
    out = as_numpy(c.decompress(payload, ctx))
    assert not out[:512].any()
    far = np.abs(np.abs(x[512:]) - ts[1]) > 1e-5 * ts[1]
    expected = np.where(x[512:] >= ts[1], ts[1], np.where(x[512:] <= -ts[1], -ts[1], 0.0))
    np.testing.assert_allclose(out[512:][far], expected[far], rtol=1e-6)


def test_twobit_sends_a_float16_threshold_beyond_its_range_as_its_largest_value():
    """float16 gradients whose t (threshold x root mean square) exceeds 65504: t travels as 65504,
    not inf, which would decode the elements sent as 0 to 0 x inf = NaN; the residual keeps the rest."""
    x = torch.tensor([60000.0, -60000.0, 1.0, 0.0] * 4, dtype=torch.float16)
    pipeline = grace.twobit(threshold=2.0)
    payload, ctx = pipeline.compressor.compress(x, "w")
    assert float(payload[0][0]) == 65504.0
    out = pipeline.compressor.decompress(payload, ctx)
    assert torch.isfinite(out).all() and not out.any()  # nothing reaches t = 2 x 42426


def test_twobit_block_size_needs_a_relative_threshold():
    with pytest.raises(ValueError, match=r"block_size=512 needs relative=True.*leave block_size out"):
        grace.twobit(0.5, relative=False, block_size=512)
    with pytest.raises(ValueError, match=r"block_size must be an int >= 0, got -1"):
        grace.twobit(block_size=-1)
    assert grace.twobit().compressor.params() == {"threshold": 1.0, "relative": True, "block_size": 512}
    # Buckets of consecutive elements: TensorFlow hands it Keras's kernels in PyTorch's order.
    assert grace.twobit().compressor.layout_sensitive
    assert not grace.twobit(block_size=0).compressor.layout_sensitive
    assert not grace.twobit(0.5, relative=False).compressor.layout_sensitive
    assert grace.twobit(0.5, relative=False).compressor.params() == {"threshold": 0.5, "relative": False}
    assert grace.twobit(0.5, relative=False).compressor.block_size == 0


@pytest.mark.parametrize("threshold", [0, -0.5, float("inf"), float("nan"), "0.5", True])
def test_twobit_threshold_must_be_positive_and_finite(threshold):
    with pytest.raises(ValueError, match=r"threshold must be a finite number > 0, got"):
        grace.twobit(threshold)


def test_signsgd_majority_vote():
    grads = [np.array([1.0, -1.0, 2.0, -3.0, 0.5], np.float32),
             np.array([1.0, 1.0, -2.0, -3.0, -0.5], np.float32),
             np.array([-1.0, 1.0, -2.0, 3.0, 0.5], np.float32)]
    group = InProcessGroup(3)
    pipelines = [grace.signsgd(min_numel=0) for _ in range(3)]
    pending = [p.start(g, "w", group.worker(r)) for r, (p, g) in enumerate(zip(pipelines, grads))]
    results = [p.finish(pd, group.worker(r), 1 / 3) for r, (p, pd) in enumerate(zip(pipelines, pending))]
    for out in results:
        np.testing.assert_array_equal(out, [1.0, 1.0, -1.0, -1.0, 1.0])


def test_signum_votes_on_momentum():
    compressor = grace.signum(beta=0.5).compressor
    from grace.backends import NumpyOps
    ops = NumpyOps()
    compressor.compress(np.array([1.0, -1.0], np.float32), "w", ops)
    payload, ctx = compressor.compress(np.array([-0.4, -0.4], np.float32), "w", ops)
    # m = 0.5 * (0.5 * [1, -1]) + 0.5 * [-0.4, -0.4] = [0.05, -0.45]
    np.testing.assert_array_equal(compressor.decompress(payload, ctx, ops), [1.0, -1.0])


def test_powersgd_reconstructs_a_matrix_of_its_rank(tensor):
    rng = np.random.default_rng(14)
    m = (rng.standard_normal((60, 2)) @ rng.standard_normal((2, 45))).astype(np.float32)
    pipeline = grace.powersgd(rank=2, memory="none", min_numel=0)
    out = as_numpy(pipeline.reduce(tensor(m), "w", InProcessGroup(1).worker(0)))
    assert np.linalg.norm(out - m) / np.linalg.norm(m) < 1e-5
    assert pipeline.stats()["bytes_sent"] == (60 + 45) * 2 * 4


def test_powersgd_converges_to_the_best_rank_r_approximation():
    rng = np.random.default_rng(15)
    u, _ = np.linalg.qr(rng.standard_normal((50, 4)))
    v, _ = np.linalg.qr(rng.standard_normal((40, 4)))
    m = (u * [10.0, 5.0, 1.0, 0.5]) @ v.T
    best = np.linalg.norm([1.0, 0.5])  # the error of the best rank-2 approximation
    pipeline = grace.powersgd(rank=2, memory="none", min_numel=0)
    group = InProcessGroup(1)
    for _ in range(10):  # warm-started power iteration, one step per call
        out = pipeline.reduce(m, "w", group.worker(0))
    assert np.linalg.norm(out - m) <= best * 1.001


def test_powersgd_over_workers_equals_rank_r_of_the_average():
    rng = np.random.default_rng(16)
    base = rng.standard_normal((30, 2)) @ rng.standard_normal((2, 20))
    grads = [(base * (r + 1)).astype(np.float64) for r in range(3)]
    group = InProcessGroup(3)
    pipelines = [grace.powersgd(rank=2, memory="none", min_numel=0) for _ in range(3)]
    # Two rounds: the second is computed from the first's sum, so workers run concurrently.
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda r: pipelines[r].reduce(grads[r], "w", group.worker(r), 1 / 3),
                                range(3)))
    for out in results:
        np.testing.assert_allclose(out, base * 2, atol=1e-9)


def test_powersgd_leaves_vectors_dense():
    assert not grace.powersgd().compresses((5000,), "float32", grace.ops_for(np.zeros(1)))
    assert grace.powersgd().compresses((100, 50), "float32", grace.ops_for(np.zeros(1)))


# --- bits on the wire -----------------------------------------------------------------------------
@pytest.mark.parametrize("numel", [8, 1001, 4099])  # ragged tails
def test_bit_counts_of_payloads(tensor, numel):
    x = gaussian(numel, 17)
    def nbytes(pipeline):
        return [as_numpy(p).nbytes for p in pipeline.compressor.compress(tensor(x), "x")[0]]
    assert nbytes(grace.signsgd()) == [math.ceil(numel / 8)]
    assert nbytes(grace.signum()) == [math.ceil(numel / 8)]
    buckets = math.ceil(numel / 512)
    assert nbytes(grace.efsignsgd()) == [4 * buckets, math.ceil(numel / 8)]   # a scale per bucket
    assert nbytes(grace.onebit()) == [8 * buckets, math.ceil(numel / 8)]      # two means per bucket
    assert nbytes(grace.terngrad()) == [4, math.ceil(numel * 2 / 8)]
    assert nbytes(grace.twobit()) == [4 * buckets, math.ceil(numel * 2 / 8)]  # relative: a t per bucket
    assert nbytes(grace.twobit(block_size=0)) == [4, math.ceil(numel * 2 / 8)]
    assert nbytes(grace.twobit(0.5, relative=False)) == [math.ceil(numel * 2 / 8)]
    norms = 4 * buckets                                                # one per bucket of 512
    assert nbytes(grace.qsgd(1)) == [norms, math.ceil(numel * 2 / 8)]   # s = 1: 2 bits
    assert nbytes(grace.qsgd(3)) == [norms, math.ceil(numel * 3 / 8)]   # 1 + ceil(log2 4)
    assert nbytes(grace.qsgd(127)) == [norms, numel]                     # 1 + 7 bits
    assert nbytes(grace.qsgd(3, block_size=0)) == [4, math.ceil(numel * 3 / 8)]
    assert nbytes(grace.natural()) == [numel, math.ceil(numel / 8)]  # 8 + 1 bits
    assert nbytes(grace.u8bit()) == [4, numel]
    assert nbytes(grace.sketch(64)) == [64 * 4, numel]
    k = min(numel, max(16, int(0.01 * numel)))                         # at least 16 (kept)
    assert nbytes(grace.topk(0.01)) == [4 * k, 4 * k]                # int32 indices
    floor = min(numel, max(1024, int(0.01 * numel)))                  # at least 1024 (min_kept)
    assert nbytes(grace.randomk(0.01)) == [4 * floor]                  # values only
    assert nbytes(grace.randomk(0.01, min_kept=1)) == [4 * max(1, int(0.01 * numel))]
    assert nbytes(grace.fp16()) == [2 * numel]


@pytest.mark.parametrize("name", NAMES)
def test_stats_equal_the_bytes_that_went_into_the_collectives(name):
    x = gaussian((40, 60), 18)
    if name == "bf16":  # the numpy reference backend has no bfloat16
        x = torch.from_numpy(x)
    group = InProcessGroup(1)
    pipeline = grace.build(name, min_numel=0)
    sent = []
    worker = group.worker(0)

    def nbytes(t):
        return grace.ops_for(t).nbytes(t)

    class Counting:
        size, rank = 1, 0

        def allreduce_async(self, t, n):
            sent.append(nbytes(t))
            return worker.allreduce_async(t, n)

        def allgather_async(self, t, n):
            sent.append(nbytes(t))
            return worker.allgather_async(t, n)

        def broadcast_async(self, t, root, n):
            sent.append(nbytes(t))
            return worker.broadcast_async(t, root, n)

        def synchronize(self, h):
            return worker.synchronize(h)

    for _ in range(2):
        pipeline.reduce(x, "w", Counting())
    stats = pipeline.stats()
    assert stats["bytes_sent"] + stats["bytes_control"] == sum(sent)
    # one flag per bucket (here a tensor), except where the tensor is allreduced as it is or cast
    # (none, fp16): its sum carries any Inf or NaN itself; else it rides in the payload's buffer
    # as 4 bytes (bf16 is gathered: its flag with it); and a 4-byte vote more where the workers
    # agree on the payload's form
    flag = 0 if name in ("none", "fp16") else 4
    vote = 4 if pipeline.compressor.agrees_on_form else 0
    assert stats["bytes_control"] == (flag + vote) * stats["tensors"]
    rounds = pipeline.compressor.rounds + (1 if vote else 0)
    assert len(sent) == 2 * rounds  # one collective per tensor and round, the flag inside
    assert pipeline.stats()["bytes_dense"] == 2 * nbytes(x)
    if name == "threshold":  # most of N(0, 1) passes 0.01: the workers agree on the dense tensor
        assert stats["bytes_sent"] == stats["bytes_dense"]
    elif name != "none":
        assert sum(sent) < 2 * nbytes(x)


# --- dtypes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_mixed_precision_comes_back_in_its_own_dtype(name, dtype):
    x = torch.from_numpy(gaussian((32, 40), 19)).to(dtype)
    pipeline = grace.build(name, min_numel=0)
    out = pipeline.reduce(x, "w", InProcessGroup(1).worker(0))
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.isfinite(out).all()


# --- error feedback ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["topk", "randomk", "threshold", "onebit", "efsignsgd", "adaq",
                                  "twobit"])
def test_error_feedback_invariant(tensor, name):
    pipeline = grace.build(name, min_numel=0)
    memory, compressor = pipeline.memory, pipeline.compressor
    ops = grace.ops_for(tensor(np.zeros(1, np.float32)))
    previous = np.zeros((30, 20), np.float32)
    for step in range(3):
        g = gaussian((30, 20), 20 + step)
        compensated = memory.compensate(tensor(g), "w", ops)
        payload, ctx = compressor.compress(compensated, "w", ops)
        memory.update(compensated, "w", compressor, payload, ctx, ops)
        sent = as_numpy(compressor.decompress(payload, ctx, ops))
        residual = as_numpy(memory.residuals["w"])
        np.testing.assert_allclose(sent + residual, g + previous, rtol=0, atol=1e-5)
        previous = residual


def test_powersgd_error_feedback_keeps_what_the_local_approximation_leaves_out():
    rng = np.random.default_rng(21)
    g = rng.standard_normal((30, 20)).astype(np.float32)
    pipeline = grace.powersgd(rank=1, min_numel=0)
    out = pipeline.reduce(g, "w", InProcessGroup(1).worker(0))
    np.testing.assert_allclose(out + pipeline.memory.residuals["w"], g, atol=1e-5)


def test_the_former_bucket_size_is_taken_as_block_size_with_one_warning(monkeypatch):
    """``bucket_size`` (the quantizers' blocks, before "bucket" came to mean the tensors that travel
    together only) still works: taken as ``block_size`` with one ``FutureWarning`` a process, by
    the factories, ``from_params`` (specs in run files) and the classes; both names with different
    values are an error naming both; a checkpoint saved under the former name loads."""
    import warnings

    from grace import compressor as base

    monkeypatch.setattr(base, "_warned_renamed", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert grace.qsgd(bucket_size=64).compressor.block_size == 64
        assert grace.from_params({"compressor": "onebit", "bucket_size": 0}).compressor.block_size == 0
        assert grace.twobit(bucket_size=32).compressor.params()["block_size"] == 32
        assert grace.efsignsgd(block_size=512, bucket_size=128).compressor.block_size == 128
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(said) == 1 and "bucket_size is now called block_size" in said[0]
    with pytest.raises(ValueError, match=r"block_size=256 and its former name bucket_size=128"):
        grace.qsgd(block_size=256, bucket_size=128)
    old = grace.qsgd(block_size=64)
    state = old.state_dict()
    state["config"] = state["config"].replace("block_size=", "bucket_size=")  # as saved before
    grace.qsgd(block_size=64).load_state_dict(state)
    with pytest.raises(ValueError, match="this compression state was saved by"):
        grace.qsgd(block_size=128).load_state_dict(state)


def test_sketchs_former_buckets_is_taken_as_bins_with_one_warning(monkeypatch):
    """sketch's ``buckets`` (its value ranges, before "bucket" came to mean the tensors that travel
    together only) still works: taken as ``bins`` with one ``FutureWarning`` a process, by the
    factory, ``from_params`` and positionally; both names with different values are an error
    naming both; a checkpoint saved under the former name loads, and only into the same bins."""
    import warnings

    import numpy as np

    from grace import compressor as base

    monkeypatch.setattr(base, "_warned_renamed", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert grace.sketch(buckets=16).compressor.bins == 16
        assert grace.from_params({"compressor": "sketch", "buckets": 32}).compressor.params() == {
            "bins": 32, "seed": 0}
        assert grace.sketch(bins=256, buckets=8).compressor.bins == 8  # bins at its default
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(said) == 1 and "buckets is now called bins" in said[0]
    assert grace.sketch(64).compressor.bins == 64 and grace.sketch().compressor.bins == 256
    with pytest.raises(ValueError, match=r"bins=64 and its former name buckets=8"):
        grace.sketch(bins=64, buckets=8)
    old = grace.sketch(bins=64, min_numel=0)
    old.reduce(np.linspace(-1, 1, 1000, dtype=np.float32), "w", InProcessGroup(1).worker(0))
    state = old.state_dict()
    assert "Sketch(bins=64, seed=0)" in state["config"]
    state["config"] = state["config"].replace("bins=", "buckets=")  # as saved before
    new = grace.sketch(bins=64, min_numel=0)
    new.load_state_dict(state)
    np.testing.assert_array_equal(new.memory.residuals["w"], old.memory.residuals["w"])
    with pytest.raises(ValueError, match="this compression state was saved by"):
        grace.sketch(bins=128, min_numel=0).load_state_dict(state)


def test_a_checkpoint_of_fp16_from_before_its_min_numel_became_0_loads():
    """fp16's ``min_numel`` default became 0 (was 1024): its checkpoints, which hold no tensor's
    state, load into ``grace.fp16()`` with their byte counts; a pipeline with state per tensor
    (top-k's residuals) saved under another ``min_numel`` still does not load (its residuals would
    be missing or left over)."""
    import numpy as np

    from grace.backends import NumpyOps

    old = grace.fp16(min_numel=1024)
    old.reduce(np.ones(2000, np.float32), "w", InProcessGroup(1).worker(0))
    state = old.state_dict()
    new = grace.fp16()
    assert new.min_numel == 0
    new.load_state_dict(state, NumpyOps())
    assert new.stats()["bytes_sent"] == old.stats()["bytes_sent"] == 4000
    topk = grace.topk(0.01, min_numel=1024)
    topk.reduce(np.arange(2000, dtype=np.float32), "w", InProcessGroup(1).worker(0))
    with pytest.raises(ValueError, match="this compression state was saved by"):
        grace.topk(0.01, min_numel=0).load_state_dict(topk.state_dict())


# --- what a sum of payloads carries ----------------------------------------------------------------
@pytest.mark.parametrize("name, backend", [  # numpy has no bfloat16
    (n, b) for n in NAMES if grace.build(n).compressor.keeps_nonfinite for b in sorted(BACKENDS)
    if (n, b) != ("bf16", "numpy")])
def test_a_codec_that_keeps_nonfinite_values_decodes_each_where_it_was(name, backend):
    """``keeps_nonfinite`` lets the exchange send no non-finite flag for a codec without state
    (``grace.transaction``): the sum of two workers' payloads, one poisoned, must decode to an Inf
    or NaN where the poisoned one held it, and every finite value of both to a finite one or to
    Inf (fp16's overflow, as Horovod's), never to NaN, so that the sum every worker receives
    holds it. The declaration is held to that here."""
    clean, poisoned = gaussian((64,), 1), gaussian((64,))
    poisoned[[3, 17, 40]] = [np.inf, -np.inf, np.nan]
    poisoned[50] = 1e30  # beyond float16's range
    compressor = grace.build(name).compressor
    ops = grace.ops_for(BACKENDS[backend](clean))
    (a, ctx), (b, _) = (compressor.compress(BACKENDS[backend](x), "x") for x in (clean, poisoned))
    decoded = as_numpy(compressor.decompress([ops.add(p, q) for p, q in zip(a, b)], ctx))
    assert decoded[3] == np.inf and decoded[17] == -np.inf and np.isnan(decoded[40])
    assert not np.isnan(np.delete(decoded, [3, 17, 40])).any()


def test_the_codecs_that_keep_nonfinite_values():
    """Which codecs declare ``keeps_nonfinite`` (the test above holds each to it): a change to the
    list is a change to which compressors send the non-finite flag."""
    assert sorted(n for n in NAMES if grace.build(n).compressor.keeps_nonfinite) == \
        ["bf16", "fp16", "none"]
