"""Property-based tests (hypothesis, derandomized): for every compressor, over shapes, dtypes and
parameters, decompress(compress(x)) has x's shape and dtype, is finite for finite x, and meets the
algorithm's own bound. And the quantizers with tables or ranges on awkward values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import grace
from grace.compressors import CATALOGUE
from grace.compressors.topk import kept
from grace.compressors.u8bit import TABLE

SETTINGS = settings(max_examples=30, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=24)
VALUES = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def roundtrip(pipeline, x):
    payload, ctx = pipeline.compressor.compress(x, "t")
    return pipeline.compressor.decompress(payload, ctx)


def buckets_of(compressor, x):
    """The slices of ``x`` that ``compressor`` quantizes with one scale each."""
    size = x.size if compressor.block_size in (0, None) else compressor.block_size
    return [slice(i, i + max(size, 1)) for i in range(0, x.size, max(size, 1))]


def terngrad_scale(compressor, x):
    """TernGrad's scale: the largest magnitude, at most ``clip`` times the root mean square."""
    big = float(np.abs(x).max()) if x.size else 0.0
    if compressor.clip is None:
        return big
    return min(big, compressor.clip * float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))))


def bound_holds(name, pipeline, x, out):
    """The algorithm's defining bound, for one draw (float64 arithmetic on the host)."""
    x = np.asarray(x, np.float64).reshape(-1)
    out = np.asarray(out, np.float64).reshape(-1)
    c = pipeline.compressor
    big = np.abs(x).max() if x.size else 0.0
    if name == "none":
        return np.array_equal(out, x)
    if name == "fp16":  # half an ulp, or half the smallest subnormal (2**-24) below the normal range
        return np.all(np.abs(out - x) <= np.maximum(np.abs(x) * 2.0**-11, 2.0**-25))
    if name == "bf16":
        return np.all(np.abs(out - x) <= np.abs(x) * 2.0**-8)
    if name in ("topk", "threshold", "dgc", "randomk"):
        kept = out != 0
        return np.array_equal(out[kept], x[kept])  # a sent entry is the entry itself
    if name == "adaq":
        return np.all((out == 0) | (np.sign(out) == np.sign(x)))
    if name == "onebit":  # per bucket, two values: the non-negative elements' mean and the others'
        return all(len(np.unique(out[b])) <= 2 and
                   np.all((x[b] >= 0) == (out[b] >= np.min(out[b][x[b] >= 0], initial=np.inf)))
                   for b in buckets_of(c, x))
    if name in ("signsgd", "signum"):
        return set(np.unique(out)) <= {-1.0, 1.0}
    if name == "efsignsgd":  # per bucket, the mean magnitude with each element's sign
        return all(np.allclose(np.abs(out[b]), np.abs(x[b]).mean(), rtol=1e-5) for b in buckets_of(c, x))
    if name == "qsgd":  # within one level of its bucket's norm
        b = c.blocks(x.size)
        rows = np.concatenate([x, np.zeros(b.pad)]).reshape(b.count, b.size)
        norms = np.repeat(np.linalg.norm(rows, axis=1), b.size)[:x.size]
        return np.all(np.abs(out - x) <= norms / c.levels * (1 + 1e-5) + 1e-30)
    if name == "terngrad":  # 0 or ±s, within s of the value clipped to [-s, s]
        s = terngrad_scale(c, x)
        return np.all(np.abs(out - np.clip(x, -s, s)) <= s * (1 + 1e-6)) and \
            np.all((out == 0) | np.isclose(np.abs(out), s, rtol=1e-5))
    if name == "natural":
        nz = x != 0
        ratio = np.abs(out[nz]) / np.abs(x[nz])
        return np.all(out[~nz] == 0) and np.all(ratio[np.abs(x[nz]) > 1e-37] >= 0.5 - 1e-6) and \
            np.all(ratio[np.abs(x[nz]) > 1e-37] <= 2 + 1e-6)
    if name == "u8bit":
        ok = np.abs(x) >= TABLE[1] * big
        return np.all(np.abs(out - x)[ok] <= (2 ** (1 / 16) - 1) * np.abs(x)[ok] * (1 + 1e-5)) and \
            np.all(np.abs(out - x)[~ok] <= TABLE[1] * big * (1 + 1e-5))
    if name == "sketch":  # every value is the mean of a bucket of values
        slack = 1e-6 * big
        return np.all(out >= x.min() - slack) and np.all(out <= x.max() + slack)
    if name == "inceptionn":
        return np.all(np.abs(out - x) <= c.error_bound / 2 + 1e-6 * np.abs(x))
    if name == "twobit":  # per bucket, ±t at or beyond t (threshold x its root mean square), else 0
        def holds(xb, ob):
            t = c.threshold * (float(np.sqrt(np.mean(xb.astype(np.float64) ** 2))) if c.relative else 1.0)
            sent = np.unique(np.abs(ob[ob != 0]))
            beyond, within = np.abs(xb) >= t * (1 + 1e-5), np.abs(xb) < t * (1 - 1e-5)
            return len(sent) <= 1 and np.allclose(sent, t, rtol=1e-5) and \
                np.all(ob[within] == 0) and np.all(np.sign(ob[beyond]) == np.sign(xb[beyond]))
        return all(holds(x[b], out[b]) for b in buckets_of(c, x))
    if name == "powersgd":
        # One worker's round trip is P Pᵀ M, with P orthonormal: an orthogonal projection of M, so
        # ||M - out||² + ||out||² = ||M||² (Pythagoras), and ||out|| <= ||M||.
        total = float(np.sum(x * x))
        rest, kept_ = float(np.sum((x - out) ** 2)), float(np.sum(out * out))
        return kept_ <= total * (1 + 1e-4) + 1e-30 and abs(rest + kept_ - total) <= 1e-4 * total + 1e-30
    raise AssertionError(name)


NUMPY_NAMES = [n for n in grace.available() if n != "bf16"]


@pytest.mark.parametrize("name", NUMPY_NAMES)
@SETTINGS
@given(data=st.data())
def test_roundtrip_properties_numpy(name, data):
    shape = data.draw(SHAPES)
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    x = data.draw(hnp.arrays(dtype, shape, elements=VALUES))
    pipeline = grace.build(name, min_numel=0)
    out = roundtrip(pipeline, x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert np.isfinite(out).all()
    assert bound_holds(name, pipeline, x, out), (name, x, out)


@pytest.mark.parametrize("name", grace.available())
@SETTINGS
@given(data=st.data())
def test_roundtrip_properties_torch_low_precision(name, data):
    shape = data.draw(SHAPES)
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16]))
    x = torch.from_numpy(data.draw(hnp.arrays(np.float32, shape,
                                              elements=st.floats(-100, 100, width=32)))).to(dtype)
    out = roundtrip(grace.build(name, min_numel=0), x)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("params", [{"ratio": r} for r in (0.001, 0.3, 1.0)])
@pytest.mark.parametrize("name", ["topk", "randomk", "dgc", "adaq"])
@SETTINGS
@given(x=hnp.arrays(np.float32, st.integers(1, 500), elements=VALUES))
def test_sparsifiers_over_their_ratio(name, params, x):
    pipeline = grace.build(name, min_numel=0, **params)
    out = roundtrip(pipeline, x)
    assert bound_holds(name, pipeline, x, out)
    if name in ("topk", "dgc"):
        assert np.count_nonzero(np.asarray(pipeline.compressor.compress(x, "t")[0][1]) >= 0) == \
            kept(params["ratio"], x.size)


@pytest.mark.parametrize("levels", [1, 2, 7, 127])
@SETTINGS
@given(x=hnp.arrays(np.float64, st.integers(1, 300), elements=VALUES))
def test_qsgd_bound_over_levels(levels, x):
    pipeline = grace.qsgd(levels)
    assert bound_holds("qsgd", pipeline, x, roundtrip(pipeline, x))


@pytest.mark.parametrize("block_size", [1, 3, 7, 0])
@SETTINGS
@given(x=hnp.arrays(np.float64, st.integers(1, 300), elements=VALUES))
def test_twobit_bound_per_bucket(block_size, x):
    """Many buckets, ragged last ones among them: ±t of each bucket's own root mean square."""
    pipeline = grace.twobit(block_size=block_size)
    assert bound_holds("twobit", pipeline, x, roundtrip(pipeline, x))


# --- awkward values for quantizers with tables or ranges ----------------------------------------
AWKWARD = {
    "zeros": np.zeros(257, np.float32),
    "max_only": np.concatenate([[3.5], np.zeros(256)]).astype(np.float32),
    "denormals": np.array([1e-40, -3e-42, 1e-45, 0.0, 2e-39] * 20, np.float32),
    "huge": np.array([3e38, -3.3e38, 1e-30, 7.0] * 20, np.float32),
    "mixed": np.array([1e-40, 0.0, 1e30, -5.0, 1e-8] * 30, np.float32),
}


@pytest.mark.parametrize("case", sorted(AWKWARD))
@pytest.mark.parametrize("name", ["u8bit", "sketch", "natural", "inceptionn", "qsgd", "terngrad"])
def test_quantizers_on_awkward_values_stay_finite_and_bounded(name, case):
    x = AWKWARD[case]
    for tensor in (lambda a: a, torch.from_numpy):
        pipeline = grace.build(name, min_numel=0)
        out = np.asarray(roundtrip(pipeline, tensor(x)))
        assert np.isfinite(out).all(), (name, case, out)
        if name not in ("qsgd", "terngrad"):  # stochastic with a norm-sized bound, checked above
            assert bound_holds(name, pipeline, x, out), (name, case, out)
        if case == "zeros":
            assert not out.any()
        if case == "max_only" and name == "natural":
            assert out[0] in (2.0, 4.0) and not out[1:].any()  # a power of two on either side
        elif case == "max_only" and name == "terngrad":  # the lone outlier is clipped to 2.5 rms
            assert out[0] == pytest.approx(terngrad_scale(pipeline.compressor, x), rel=1e-5)
            assert out[0] < 3.5 and not out[1:].any()
        elif case == "max_only" and name != "sketch":
            assert out[0] == pytest.approx(3.5, rel=0.05) and not out[1:].any()


def test_natural_rounds_denormals_to_zero_or_the_smallest_normal():
    x = np.full(4000, 2.0**-127, np.float32)  # half the smallest normal float32
    out = np.asarray(roundtrip(grace.natural(), x))
    assert set(np.unique(out)) <= {0.0, 2.0**-126}
    assert abs(out.mean() - 2.0**-127) < 5 * 2.0**-126 / 2 / math.sqrt(4000)  # unbiased


# --- never more bytes than dense ------------------------------------------------------------------
def adversarial(kind: str, numel: int, seed: int):
    """Inputs that push a compressor's payload up: ties, constants, sparsity, huge values."""
    rng = np.random.default_rng(seed)
    if kind == "constant":
        return np.full(numel, 0.75, np.float32)
    if kind == "plus_minus":  # ±c: every element ties with the threshold of each sign
        return np.where(rng.random(numel) < 0.5, -0.75, 0.75).astype(np.float32)
    if kind == "sparse":
        x = np.zeros(numel, np.float32)
        x[rng.integers(0, numel, max(1, numel // 100))] = rng.standard_normal(max(1, numel // 100))
        return x
    if kind == "large":  # every element beyond INCEPTIONN's 16-bit class and a threshold's bar
        return (rng.standard_normal(numel) * 1e3).astype(np.float32)
    return rng.standard_normal(numel).astype(np.float32)


KINDS = ["constant", "plus_minus", "sparse", "large", "gaussian"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(cls.name for cls in CATALOGUE))
def test_never_more_bytes_than_dense(name, kind):
    """On 2 workers (in process), through the pipeline with its defaults (the dense fallback, the
    lengths of variable-size payloads and all), for tensors around min_numel, float32 and float16:
    the payload bytes a worker puts into collectives never exceed the dense tensor's. Every case is
    run, not sampled: one combination that breaks the promise is enough."""
    import torch

    from grace.backends import InProcessGroup

    for numel in (1023, 1024, 1031, 4096):
        for half in (False, True):
            x = torch.from_numpy(adversarial(kind, numel, numel))
            x = x.half() if half else x
            pipelines = [grace.build(name) for _ in range(2)]
            group = InProcessGroup(2)
            for _ in range(2):  # a second step with residuals in the compensated tensor
                # Each worker in a thread, as in its own process: workers that agree on the
                # payload's form wait for each other in start.
                run_threads([lambda r=r, p=p: p.reduce(x * (r + 1), "t", group.worker(r))
                             for r, p in enumerate(pipelines)])
            for pipeline in pipelines:
                stats = pipeline.stats()
                assert stats["bytes_sent"] <= stats["bytes_dense"], (numel, half, stats)


def run_threads(functions):
    """Call each function in its own thread (two-round compressors wait for the others)."""
    import threading

    errors = []

    def call(fn):
        try:
            fn()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(fn,)) for fn in functions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
