"""grace/native's fused loops give the bits of the composite Ops code they replace: the same random
numbers, the same packed codes, the same decoded values, the same sums. Sizes span one range and
several (the loops split large tensors between threads) and are not multiples of 8."""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import grace
from frameworks.torch.ops import TorchOps
from grace import kernels, native, steps
from grace.backends.numpy_ops import NumpyOps
from grace.ops import Ops
from grace.rng import counter_uniform_bits, draw_indices, draw_uniform, reference_indices, reference_uniform

TORCH = TorchOps()
NUMPY = NumpyOps()
SIZES = [native.MIN_NUMEL + 5, 2 * native.PARALLEL_NUMEL + 1001]
SEED = 0x1234_5678_9ABC_DEF0

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C compiler: {native.reason()}")


def data(n: int, kind: str = "gaussian", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if kind == "integers":  # float64 sums of these are exact in any order
        x = torch.round(x * 100)
    x[:7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 0.5])
    return x


def composite(step: str):
    """A shared step's own (composite) definition, run over torch tensors."""
    return lambda *args, **params: getattr(steps, step).composite(TORCH, *args, **params)


@pytest.mark.parametrize("n", SIZES)
def test_the_counter_based_draws_are_the_same_in_c_numpy_and_torch(n):
    expected = reference_uniform(n, SEED)
    assert expected.dtype == np.float32 and 0.0 <= expected.min() and expected.max() < 1.0
    np.testing.assert_array_equal(draw_uniform(n, SEED), expected)
    # The torch path (taken on CUDA) computes the hash in int64.
    bits = counter_uniform_bits(torch.arange(n, dtype=torch.int64), SEED)
    np.testing.assert_array_equal((bits.to(torch.float32) * 2.0**-24).numpy(), expected)
    # Uniform in the mean and variance, to a few standard errors (fixed seed).
    assert abs(expected.mean() - 0.5) < 4 * np.sqrt(1 / 12 / n)
    assert abs(expected.var() - 1 / 12) < 4 * np.sqrt(1 / 180 / n)
    # Another seed gives other numbers.
    assert np.mean(draw_uniform(n, SEED + 1) == expected) < 1e-3


@pytest.mark.parametrize("n, k", [(1, 0), (1, 1), (10, 3), (10, 7), (64, 32), (65, 33), (100, 100),
                                  (5_000, 50), (1_000_003, 600_000), (2_359_296, 23_592)])
def test_random_k_draws_the_same_indices_in_c_and_numpy(n, k):
    # Both ends of the bitmap's last word, the complement (k > n / 2), none and all.
    for seed in (0, 5, SEED):
        expected = reference_indices(n, k, seed)
        got = draw_indices(n, k, seed)
        assert got.dtype == expected.dtype and expected.size == k
        np.testing.assert_array_equal(got, expected)
    assert k in (0, n) or not np.array_equal(draw_indices(n, k, 1), draw_indices(n, k, 2))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("levels, bits", [(1, 2), (7, 4), (15, 5), (127, 8)])
@pytest.mark.parametrize("block", [None, 512, 1000])
def test_quantize_levels_is_the_composite_code(n, levels, bits, block):
    x = data(n, seed=levels)
    if block is None:
        # One divisor; TernGrad's clip below the largest magnitude, so that some levels saturate.
        divisor = TORCH.norm(x) if levels > 1 else TORCH.scale(TORCH.max_abs(x), 0.5)
    else:
        divisor = torch.rand(-(-n // block), generator=torch.Generator().manual_seed(block)) + 0.5
    params = dict(seed=(lambda step: SEED + int(step), 3), levels=levels, bits=bits,
                  block=n if block is None else block)
    fused = steps.quantize_levels(TORCH, x, divisor, **params)
    expected = composite("quantize_levels")(x, divisor, **params)
    assert fused.dtype == torch.uint8 and fused.numel() == (n * bits + 7) // 8
    assert torch.equal(fused, expected)
    np.testing.assert_array_equal(
        fused.numpy(), steps.quantize_levels.composite(NUMPY, x.numpy(), divisor.numpy(), **params))
    top = int((TORCH.unpack_bits(fused, bits, n).long() // 2).max())
    # Never beyond the top level; exactly at it where divisors lie below the largest magnitudes.
    assert top == levels if block is not None or levels == 1 else top < levels


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["gaussian", "integers"])
@pytest.mark.parametrize("block", [512, 1000, SIZES[-1] + 1])
def test_block_sums_are_the_composite_code(n, kind, block):
    x = data(n, kind)
    fused = steps.block_sums(TORCH, x, block=block)
    expected = composite("block_sums")(x, block=block)
    assert fused.shape == (4, -(-n // block)) and fused.dtype == torch.float64
    assert torch.equal(fused[0], expected[0])  # counts
    if kind == "integers":
        assert torch.equal(fused, expected)
    else:  # float64 sums in another order: equal once rounded to float32 but for a rare last bit
        torch.testing.assert_close(fused, expected, rtol=2.0**-23, atol=0.0)
    first = x[:min(block, n)].double()
    assert fused[0, 0] == (first >= 0).sum() and fused[3, 0] == pytest.approx((first * first).sum().item())
    assert torch.equal(steps.sign_bits(TORCH, x), composite("sign_bits")(x))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_unpack_blocks_is_the_composite_code(n, bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int32)
    packed = TORCH.pack_bits(codes, bits)
    tables = torch.randn(-(-n // 512), 1 << bits, generator=g)
    decoded = steps.unpack_blocks(TORCH, packed, tables, bits=bits, n=n, block=512)
    assert torch.equal(decoded, tables[torch.arange(n) // 512, codes.long()])
    assert torch.equal(decoded, composite("unpack_blocks")(packed, tables, bits=bits, n=n, block=512))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_unpack_blocks_onto_a_base_is_the_composite_code(n, bits):
    """Decoding onto a tensor (the residual, the sum over workers) adds in the same pass: bit for
    bit ``base + decoded``, zeros of either sign included."""
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int32)
    packed = TORCH.pack_bits(codes, bits)
    tables = torch.randn(-(-n // 512), 1 << bits, generator=g)
    tables[0] = torch.tensor([-0.0, 0.0] * (1 << bits))[: 1 << bits]
    base = data(n, seed=bits)
    onto = steps.unpack_blocks_onto(TORCH, packed, tables, base, bits=bits, n=n, block=512)
    expected = base + tables[torch.arange(n) // 512, codes.long()]
    assert torch.equal(onto, expected) and torch.equal(torch.signbit(onto), torch.signbit(expected))
    with native.disabled():
        assert torch.equal(onto, composite("unpack_blocks_onto")(packed, tables, base, bits=bits, n=n,
                                                                 block=512))


@pytest.mark.parametrize("block", [7, 100, 4093])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unpack_blocks_whose_blocks_end_inside_a_byte(block, bits, monkeypatch):
    """The loop decodes a block's whole bytes together and its ends one code at a time: blocks of
    sizes that are no multiple of the codes in a byte, over ranges split between threads, give the
    table's values, onto a base too."""
    n = 2 * native.PARALLEL_NUMEL + 1001
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, n, dtype=np.int32)
    packed = TORCH.pack_bits(torch.from_numpy(codes), bits).numpy()
    tables = rng.standard_normal((-(-n // block), 1 << bits)).astype(np.float32)
    base = rng.standard_normal(n).astype(np.float32)
    expected = tables[np.arange(n) // block, codes]
    monkeypatch.setenv("GRACE_NATIVE_THREADS", "3")
    assert len(native._ranges(n)) == 3
    assert np.array_equal(native.unpack_blocks(packed, tables, bits, n, block), expected)
    assert np.array_equal(native.unpack_blocks_onto(packed, tables, base, bits, n, block),
                          base + expected)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_unpack_values_is_the_composite_code(n, bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int32)
    packed = TORCH.pack_bits(codes, bits)
    values = torch.randn(1 << bits, generator=g)
    decoded = steps.unpack_values(TORCH, packed, values, bits=bits, n=n)
    assert torch.equal(decoded, values[codes.long()])
    assert torch.equal(decoded, composite("unpack_values")(packed, values, bits=bits, n=n))
    assert torch.equal(decoded, Ops.unpack_values(TORCH, packed, bits, n, values))


@pytest.mark.parametrize("n", SIZES)
def test_sums_norm_max_abs_and_the_nonfinite_flag(n):
    x = data(n, "integers")
    wide = x.double()
    assert TORCH.sum(x).item() == wide.sum().float().item()
    assert TORCH.norm(x).item() == wide.norm().float().item()
    assert TORCH.max_abs(x).item() == x.abs().max().item()
    x = data(n)
    torch.testing.assert_close(TORCH.sum(x), x.double().sum().float().reshape(1), rtol=2.0**-23,
                               atol=1e-6)
    assert TORCH.nonfinite_flag(x).item() == 0.0
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[n - 3] = bad
        assert TORCH.nonfinite_flag(y).item() == 1.0
        if bad != bad:
            assert torch.isnan(TORCH.max_abs(y)).item()
        else:
            assert TORCH.max_abs(y).item() == float("inf")


@pytest.mark.parametrize("n", SIZES)
def test_scaled_sum_rounds_as_the_composite_code(n):
    a, b = data(n, seed=1), data(n, seed=2)
    assert torch.equal(steps.scaled_sum(TORCH, a, b, alpha=0.9, beta=0.1),
                       composite("scaled_sum")(a, b, alpha=0.9, beta=0.1))
    assert torch.equal(steps.scaled_sum(TORCH, None, b, alpha=0.9, beta=0.1), b * 0.1)




@pytest.fixture
def loop_calls(monkeypatch):
    """How many times each loop of grace.native ran (``native.run_kernel``)."""
    import collections

    calls = collections.Counter()
    run = native.run_kernel
    monkeypatch.setattr(native, "run_kernel",
                        lambda kernel, *a, **kw: calls.update([kernel]) or run(kernel, *a, **kw))
    return calls


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("workers", [2, 3, 8])
def test_bf16_rows_sum_rounds_as_the_composite_code(n, workers, loop_calls):
    """The sum of gathered bfloat16 bits (Horovod cannot reduce bfloat16), as the torch adapter
    takes it: the loop runs and gives the composite code's bits (rank order, float32, one rounding
    to nearest even), ties, subnormal, infinite and overflowing sums among them; a NaN sum is a
    NaN (the loop writes the quiet 0x7fc0)."""
    from frameworks.torch.collectives import summed_bf16
    from grace.steps import bf16_rows_sum

    g = torch.Generator().manual_seed(workers)
    x = torch.randn(workers, n, generator=g) * torch.exp2(torch.randint(-20, 20, (workers, n), generator=g))
    # subnormals, a float32 overflow, an infinity, a NaN
    x[:, :6] = torch.tensor([1.0, 1e-39, 3e38, 1.0, 1.0, -1.0]).expand(workers, 6)
    x[1, 3], x[1, 4], x[0, 5] = float("inf"), float("nan"), -float("inf")
    x[:, 6:9] = 0.0  # sums halfway between two bfloat16: to the even one, down, up, and up to Inf
    largest = torch.tensor(0x7F7F, dtype=torch.int16).view(torch.bfloat16).float().item()
    x[0, 6], x[1, 6], x[0, 7], x[1, 7] = 1.0, 2.0**-8, 1.0 + 2.0**-7, 2.0**-8
    x[0, 8], x[1, 8] = largest, 2.0**119  # half the spacing of bfloat16 at its largest finite value
    rows = x.to(torch.bfloat16).view(torch.int16)
    got = summed_bf16(rows, (n,)).view(torch.int16)
    assert got.dtype == torch.int16 and got.shape == (n,)
    assert loop_calls["bf16_rows_sum"] == 1  # the loop ran, not the composite code
    expected = bf16_rows_sum.composite(TORCH, rows, workers=workers, n=n)
    values, wanted = got.view(torch.bfloat16).float(), expected.view(torch.bfloat16).float()
    assert torch.equal(values.isnan(), wanted.isnan()) and values[4].isnan()
    assert torch.equal(got[~wanted.isnan()], expected[~wanted.isnan()])
    assert got[4].item() == 0x7FC0
    assert values[3].item() == float("inf") and values[2].item() == float("inf")  # 3e38 x 2 overflows
    assert values[6].item() == 1.0 and values[7].item() == 1.0 + 2.0**-6
    assert values[8].item() == float("inf")  # a finite float32 sum that rounds past the largest
    # the widening is exact and the float32 sum is rank order's: the same as summing the floats
    by_hand = x.to(torch.bfloat16).float()
    total = by_hand[0].clone()
    for r in range(1, workers):
        total += by_hand[r]
    finite = ~total.isnan()
    assert torch.equal(got[finite], total.to(torch.bfloat16).view(torch.int16)[finite])
    small = summed_bf16(rows[:, :100].contiguous(), (10, 10))  # below MIN_NUMEL: the composite code
    assert loop_calls["bf16_rows_sum"] == 1 and small.shape == (10, 10)
    assert torch.equal(small.reshape(-1)[:4].view(torch.int16), got[:4])
    with pytest.raises(ValueError, match="rows: 2 rows of 5 elements are 10, got 9"):
        native.bf16_rows_sum(np.zeros(9, np.int16), 2, 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("factor", [1.0, 0.5, 1 / 3])
def test_a_16_bit_sum_widens_into_its_gradient_as_a_cast_and_a_product(dtype, factor, monkeypatch):
    """``TorchOps.scale_into`` of a 16-bit sum into a float32 tensor (fp16's and bf16's results,
    written into a DDP bucket or a gradient) runs the one-pass loop, and gives, for every one of the
    65,536 bit patterns, the bits of a cast and then a product in float32 (NaNs included); the C
    loop's portable conversion (what runs without F16C, and on a range's last elements) gives them
    too, run on ranges of 7 elements where the vector loop never starts."""
    calls = []
    widen = native.widen_scaled_into
    monkeypatch.setattr(native, "widen_scaled_into", lambda *a: calls.append(a[1:3]) or widen(*a))
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    expected = x.float() * factor if factor != 1.0 else x.float()
    out = torch.full((bits.numel(),), 7.0)
    assert TORCH.scale_into(x, factor, out) is out
    assert calls == [(dtype == torch.bfloat16, factor)]
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    assert out.isnan().sum() == (2046 if dtype == torch.float16 else 254)  # every NaN pattern
    portable = np.full(bits.numel(), 7.0, np.float32)
    ranges = [(start, min(7, bits.numel() - start)) for start in range(0, bits.numel(), 7)]
    native.run(native.WIDEN_SCALED, bits.numel(), [bits.numpy()], [portable],
               {"brain": int(dtype == torch.bfloat16), "factor": factor}, ranges=ranges)
    np.testing.assert_array_equal(portable.view(np.int32), expected.view(torch.int32).numpy())
    # Below MIN_NUMEL the composite code runs: the same values (torch's own scalar loop may give a
    # NaN another payload than its vector loop does, so NaNs are compared as NaNs there).
    # The vector loop from a range that starts mid-tensor, over a length not a multiple of 8, writes
    # its elements and nothing past them.
    padded = np.full(bits.numel() + 8, 7.0, np.float32)
    native.run(native.WIDEN_SCALED, bits.numel(), [bits.numpy()], [padded],
               {"brain": int(dtype == torch.bfloat16), "factor": factor},
               ranges=[(0, 13), (13, bits.numel() - 13 - 5), (bits.numel() - 5, 5)])
    np.testing.assert_array_equal(padded[:-8].view(np.int32), expected.view(torch.int32).numpy())
    assert (padded[-8:] == 7.0).all()
    # A sum in the memory it is to be widened into becomes a new tensor, not a cast over itself.
    shared = torch.zeros(1 << 14)
    shared.view(dtype)[: 1 << 14] = x[: 1 << 14]
    got = TORCH.scale_into(shared.view(dtype)[: 1 << 14], factor, shared)
    assert len(calls) == 1 and got is not shared
    assert torch.equal(got.view(torch.int32), expected[: 1 << 14].view(torch.int32))
    small = torch.full((10,), 7.0)
    TORCH.scale_into(x[31740:31750], factor, small)  # fp16: its largest, -inf and NaNs
    assert len(calls) == 1 and torch.equal(small.isnan(), expected[31740:31750].isnan())
    finite = ~small.isnan()
    assert torch.equal(small[finite].view(torch.int32), expected[31740:31750][finite].view(torch.int32))
    with pytest.raises(ValueError, match="out: a contiguous float32 array of 4 elements, got float64 of 4"):
        native.widen_scaled_into(np.zeros(4, np.int16), False, 1.0, np.zeros(4))


def test_tensorflow_sums_gathered_bf16_bits_through_the_loop_eagerly_and_in_a_graph(loop_calls):
    """TensorFlow's bfloat16 sum (its adapter's allreduce, Horovod gathering the bits) takes the
    same loop, through tf.numpy_function in a traced graph, and gives torch's bits; a tensor whose
    size a graph knows only when it runs is summed by the composite code, to the same bits."""
    import tensorflow as tf

    from frameworks.tensorflow.collectives import summed_bf16
    from grace.steps import bf16_rows_sum

    n, workers = native.CROSSING_MIN_NUMEL + 3, 3
    rows = data(workers * n, seed=11).to(torch.bfloat16).view(torch.int16).reshape(workers, n)
    expected = bf16_rows_sum.composite(TORCH, rows, workers=workers, n=n).numpy()
    like = tf.zeros([n], tf.bfloat16)
    traced = tf.function(lambda r, t: summed_bf16(r, t, workers))
    unknown = tf.function(lambda r, t: summed_bf16(r, t, workers),
                          input_signature=[tf.TensorSpec([None, None], tf.int16),
                                           tf.TensorSpec([None], tf.bfloat16)])
    for way, calls in ((lambda r: summed_bf16(r, like, workers), 1), (lambda r: traced(r, like), 1),
                       (lambda r: unknown(r, like), 0)):
        before = loop_calls["bf16_rows_sum"]
        got = way(tf.constant(rows.numpy()))
        assert loop_calls["bf16_rows_sum"] - before == calls
        assert got.dtype == tf.bfloat16 and got.shape == (n,)
        np.testing.assert_array_equal(tf.bitcast(got, tf.int16).numpy(), expected)


def test_tensorflows_bfloat16_casts_and_16_bit_sums_take_the_loops_with_tensorflows_bits(monkeypatch):
    """TensorFlow's casts between float32 and bfloat16 (bf16's encoding and decoding) and its
    16-bit sums widened and scaled (fp16's and bf16's ``scale_into``) run grace/native's loops,
    eagerly and in a traced graph, with ``tf.cast``'s bits: every bfloat16 pattern widened; float32
    rounded at ties, across subnormals, at overflow, and NaNs of either sign; a size a graph knows
    only when it runs, and a small tensor, go to TensorFlow's own ops. Every float16 and bfloat16
    pattern widened and scaled gives IEEE float32's product, which is TensorFlow's but where its
    flush-to-zero makes a subnormal product 0."""
    import tensorflow as tf

    from frameworks.tensorflow.ops import TensorFlowOps

    ops = TensorFlowOps()
    calls = collections.Counter()
    for name in ("bf16_round", "widen_scaled"):
        loop = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _n=name, _l=loop: calls.update([_n]) or _l(*a))
    every = tf.constant(np.arange(-(1 << 15), 1 << 15).astype(np.int16))
    g = np.random.default_rng(5)
    x = (g.standard_normal(1 << 17) * np.exp2(g.integers(-140, 120, 1 << 17))).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -3e-39, 3.4e38,
                         np.float32(1 + 2.0**-8), np.float32(1 + 3 * 2.0**-8), 3.3961776e38], np.float32)
    x[:specials.size] = specials
    # NaNs with payloads, signalling and not, of either sign, each to 0x7fc0 (rounding their bits
    # would give an infinity or -0)
    payloads = np.array([0x7F800001, 0x7FFFFFFF, 0xFF800001, 0xFFBFFFFF, 0x7FC0FFFF], np.uint32)
    x[specials.size:specials.size + payloads.size] = payloads.view(np.float32)
    x = tf.constant(x)

    def bits(t):
        return tf.bitcast(t, tf.int16 if t.dtype.size == 2 else tf.int32).numpy()

    traced = tf.function(lambda t, d: ops.cast(t, d), reduce_retracing=True)
    for cast in (ops.cast, lambda t, d: traced(t, d)):
        np.testing.assert_array_equal(bits(cast(x, "bfloat16")), bits(tf.cast(x, tf.bfloat16)))
        wide = tf.bitcast(every, tf.bfloat16)
        np.testing.assert_array_equal(bits(cast(wide, "float32")), bits(tf.cast(wide, tf.float32)))
    assert calls == {"bf16_round": 2, "widen_scaled": 2}
    for dtype in (tf.float16, tf.bfloat16):
        half = tf.bitcast(every, dtype)
        widened = tf.cast(half, tf.float32)  # exact: the same bits either way (above)
        expected = widened.numpy() * np.float32(1 / 3)  # IEEE float32, as torch and the loop
        got = ops.scale_into(half, 1 / 3, tf.zeros([every.shape[0]])).numpy()
        assert np.array_equal(np.isnan(got), np.isnan(expected))
        finite = ~np.isnan(expected)
        np.testing.assert_array_equal(got[finite].view(np.int32), expected[finite].view(np.int32))
        # TensorFlow's own product flushes a subnormal result to zero (its CPU threads run with
        # flush-to-zero); everywhere else it gives the loop's bits.
        own = (widened * tf.constant(1 / 3, tf.float32)).numpy()
        differ = finite & (own.view(np.int32) != got.view(np.int32))
        assert differ.any() == (dtype == tf.bfloat16)  # float16's products are never subnormal
        assert (own[differ] == 0).all() and (np.abs(got[differ]) < 2.0**-126).all()
    assert calls["widen_scaled"] == 4
    unknown = tf.function(lambda t: ops.cast(t, "bfloat16"),
                          input_signature=[tf.TensorSpec([None], tf.float32)])
    np.testing.assert_array_equal(bits(unknown(x)), bits(tf.cast(x, tf.bfloat16)))
    np.testing.assert_array_equal(bits(ops.cast(x[:100], "bfloat16")), bits(tf.cast(x[:100], tf.bfloat16)))
    assert calls == {"bf16_round": 2, "widen_scaled": 4}


def assert_same(got, expected, what):
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    if got.dtype.kind == "f":
        # Float64 sums added in another order may round to a neighbouring float; nothing else may
        # differ.
        np.testing.assert_allclose(got, expected, rtol=2.0**-22, atol=0, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)


@pytest.mark.parametrize("name", grace.available())
def test_every_compressor_gives_the_composite_codes_payloads(name):
    """Every compressor, on a tensor the loops take, two steps (random draws and state move on):
    the payloads and decoded values with grace/native are those of the composite code."""
    n = SIZES[1]
    x = data(n, seed=4)
    x = x[: (n // 1001) * 1001].reshape(-1, 1001) if name == "powersgd" else x
    runs = {}
    for label in ("fused", "composite"):
        compressor = grace.build(name).compressor
        rounds = []
        with contextlib.nullcontext() if label == "fused" else native.disabled():
            for _ in range(2):
                payload, ctx = compressor.compress(x, "w")
                decoded = compressor.decompress(payload, ctx)
                rounds.append(([TORCH.to_numpy(p) for p in payload], TORCH.to_numpy(decoded)))
        runs[label] = rounds
    for (payload, decoded), (expected_payload, expected_decoded) in zip(runs["fused"], runs["composite"]):
        assert len(payload) == len(expected_payload)
        for i, (a, b) in enumerate(zip(payload, expected_payload)):
            assert_same(a, b, f"{name}: payload {i}")
        assert_same(decoded, expected_decoded, f"{name}: decoded")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [1, 7, 512, 0])
def test_twobit_codes_are_the_composite_code(n, block, monkeypatch):
    """Two-bit's loop against its composite code, bit for bit: blocks that straddle the threads'
    ranges (7; three ranges, so that one starts inside a block), one element each (1), the default
    and one for the whole tensor (0); a threshold of 0 (an all-zero block's), x at +-t, NaN and the
    infinities; and the first 16 codes against the definition."""
    from grace.compressors import twobit

    monkeypatch.setenv("GRACE_NATIVE_THREADS", "3")
    if n > native.PARALLEL_NUMEL:
        assert len(native._ranges(n)) == 3 and any(start % 7 for start, _ in native._ranges(n))
    x = data(n, seed=5) * 0.01
    x[7:14] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.01, -0.01, 0.0, -0.0])
    size = n if block == 0 else block
    count = -(-n // size)
    thresholds = torch.rand(count, generator=torch.Generator().manual_seed(6)) * 0.02
    thresholds[:3] = 0.01  # x at +-t in the first blocks
    if count > 4:  # an all-zero block, whose t is 0: its zeros code 11
        x[3 * size:4 * size] = 0.0
        thresholds[3] = 0.0
    fused = twobit.codes(TORCH, x, thresholds, n=n, block=size)
    expected = twobit.codes.composite(TORCH, x, thresholds, n=n, block=size)
    assert fused.dtype == torch.uint8 and fused.numel() == -(-2 * n // 8)
    assert torch.equal(fused, expected)
    assert kernels.run(TORCH, "twobit_codes", [x, thresholds], n=n, block=size) is not None  # it ran
    unpacked = [(int(byte) >> (2 * j)) & 3 for byte in fused[:4] for j in range(4)]
    t = [float(thresholds[i // size]) for i in range(16)]
    want = [3 if v >= t[i] else 2 if -v >= t[i] and v < 0 else 0 for i, v in enumerate(x[:16].tolist())]
    assert unpacked == want  # the first 16 codes by the definition
    with pytest.raises(ValueError, match="thresholds"):
        twobit._codes_loop(x.numpy(), thresholds.numpy()[:-1], n, size)
    # x already padded to whole blocks, as compress_flat gives it: the padding of 1e3 would code 11,
    # and neither way lets it into the codes of the tensor's n elements
    padded = torch.cat([x, torch.full((count * size - n,), 1e3)])
    assert torch.equal(twobit.codes(TORCH, padded, thresholds, n=n, block=size), fused)
    assert torch.equal(twobit.codes.composite(TORCH, padded, thresholds, n=n, block=size), fused)


@pytest.mark.parametrize("n", SIZES)
def test_inceptionn_moves_every_class_like_the_composite_code(n):
    """INCEPTIONN's loops move members four tags at a time: on magnitudes spread so that all four
    classes interleave (and NaN and infinities among them), both ways, bit for bit."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.empty(n).uniform_(-4, 2, generator=g))
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 40000.0])
    runs = []
    for context in (contextlib.nullcontext(), native.disabled()):
        with context:
            compressor = grace.build("inceptionn").compressor
            payload, ctx = compressor.compress(x, "w")
            runs.append(([p.numpy() for p in payload], compressor.decompress(payload, ctx).numpy()))
    (payload, decoded), (expected_payload, expected_decoded) = runs
    assert all(len(p) > n // 50 for p in payload[1:]), "every class has members"
    for i, (a, b) in enumerate(zip(payload, expected_payload)):
        assert_same(a, b, f"payload {i}")
    np.testing.assert_array_equal(decoded, expected_decoded)


def test_inceptionn_refuses_tags_that_disagree_with_the_members():
    x = data(SIZES[0])
    compressor = grace.build("inceptionn").compressor
    (tags, small, medium, large), ctx = compressor.compress(x, "w")
    with pytest.raises(ValueError, match="inceptionn payload"):
        compressor.decompress([tags, small[:-1], medium, large], ctx)


def test_grace_native_0_turns_the_loops_off():
    script = ("import torch, grace\nfrom grace import native\n"
              "c = grace.build('qsgd').compressor\n"
              "p, ctx = c.compress(torch.randn(100000), 'w')\n"
              "print(native.available(), native.reason(), c.decompress(p, ctx).shape[0])\n")
    env = dict(os.environ, GRACE_NATIVE="0")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.stdout.split() == ["False", "disabled", "by", "GRACE_NATIVE=0", "100000"]


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "onebit", "efsignsgd", "signsgd", "signum",
                                  "natural", "u8bit", "sketch", "threshold", "dgc", "topk", "adaq",
                                  "inceptionn", "twobit"])
def test_tensorflow_takes_the_same_loops_in_a_graph(name):
    """Under tf.function the loops run through tf.numpy_function and give torch's payloads and
    decoded values."""
    import tensorflow as tf

    n = SIZES[1]
    x = data(n, seed=9)
    for_torch, for_tf = grace.build(name).compressor, grace.build(name).compressor
    expected = []
    for _ in range(2):  # a second step: counters (random draws) and momentum move on
        payload, ctx = for_torch.compress(x, "w")
        expected.append(([p.numpy() for p in payload], for_torch.decompress(payload, ctx).numpy()))

    @tf.function
    def step(t):
        payload, ctx = for_tf.compress(t, "w")
        return payload, for_tf.decompress(payload, ctx)

    def by_index(payload):
        """Top-k's entries come in any order: compare them sorted by index."""
        if name not in ("topk", "dgc"):
            return payload
        values, indices = payload
        order = np.argsort(indices, kind="stable")
        return [values[order], indices[order]]

    for payload, decoded in expected:
        got_payload, got_decoded = step(tf.constant(x.numpy()))
        got_payload, payload = by_index([p.numpy() for p in got_payload]), by_index(payload)
        assert len(got_payload) == len(payload)
        for i, (a, b) in enumerate(zip(got_payload, payload)):
            assert_same(a, b, f"{name}: payload {i}")
        assert_same(got_decoded.numpy(), decoded, f"{name}: decoded")


@pytest.mark.parametrize("key_bits", [14, 16])
@pytest.mark.parametrize("kind", ["gaussian", "log-spaced", "infinite", "ties"])
def test_the_bin_index_bounds_every_count(kind, key_bits):
    """For every key (of 14 bits for sketch's smaller tensors, else 16), [low, high] are the counts
    of boundaries <= the lowest and the highest float with that key (what the bin search relies
    on to be exact)."""
    from grace.compressors.u8bit import BOUNDARIES

    boundaries = {
        "gaussian": np.sort(np.random.default_rng(1).standard_normal(255)).astype(np.float32),
        "log-spaced": BOUNDARIES,
        "infinite": np.array([-np.inf, -0.0, 0.0, 1.0, np.inf], np.float32),
        "ties": np.array([-1.0, 0.5, 0.5, 0.5, 2.0], np.float32),
    }[kind]
    _, low, high, shift = native.bin_index(boundaries, key_bits)
    assert 32 - shift == key_bits
    keys = np.arange(1 << (32 - shift), dtype=np.uint32) << shift
    ends = np.stack([keys, keys | ((1 << shift) - 1)]).view(np.float32)
    lowest, highest = np.fmin(ends[0], ends[1]), np.fmax(ends[0], ends[1])
    nan = np.isnan(lowest)
    expected_low = np.where(nan, 0, np.searchsorted(boundaries, lowest, side="right"))
    expected_high = np.where(nan, 0, np.searchsorted(boundaries, highest, side="right"))
    np.testing.assert_array_equal(low, expected_low)
    np.testing.assert_array_equal(high, expected_high)


def test_scatter_add_adds_repeats_and_refuses_indices_out_of_range():
    n = native.MIN_NUMEL + 3
    indices = torch.tensor([5, 7, 5, n - 1], dtype=torch.int32)
    values = torch.tensor([1.0, 2.0, 0.5, 4.0])
    out = TORCH.scatter_add(n, indices, values)
    expected = torch.zeros(n).index_add_(0, indices, values)
    assert torch.equal(out, expected)
    with pytest.raises(IndexError, match=f"index {n} is out of range for {n} elements"):
        TORCH.scatter_add(n, torch.tensor([1, n], dtype=torch.int64), torch.ones(2))


def test_one_policy_decides_when_a_loop_runs():
    """``native.worth_running`` is the one place adapters ask: by size (higher where each call
    crosses into the host), dtype, memory and layout."""
    n = native.MIN_NUMEL
    assert native.worth_running(n, ["float32"])
    assert not native.worth_running(n - 1, ["float32"])
    assert not native.worth_running(None, ["float32"])  # a size known only when a graph runs
    assert not native.worth_running(n, ["float32"], crossing=True)
    assert native.worth_running(native.CROSSING_MIN_NUMEL, ["float32"], crossing=True)
    assert not native.worth_running(n, ["float64"])
    assert native.worth_running(n, ["uint8"], accept=("float32", "uint8"))
    assert not native.worth_running(n, ["float32"], on_host=False)
    assert not native.worth_running(n, ["float32"], contiguous=False)


def test_a_loop_under_tf_function_gives_its_output_the_inputs_shape():
    """The momentum's scaled sum of a 784 x 512 weight (more than the ``CROSSING_MIN_NUMEL``
    elements from which TensorFlow runs the loops): the loop returns a flat array, and the graph's
    result has the weight's shape when it runs, not only in its static shape."""
    import tensorflow as tf

    a = tf.random.stateless_normal([784, 512], seed=[1, 2])
    b = tf.random.stateless_normal([784, 512], seed=[3, 4])
    from frameworks.tensorflow.ops import TensorFlowOps

    ops = TensorFlowOps()
    assert kernels.run(ops, "scaled_sum", [a, b], alpha=0.9, beta=0.1) is not None

    @tf.function
    def step(a, b):
        return steps.scaled_sum(ops, a, b, alpha=0.9, beta=0.1) + a  # an op that needs the shape

    got = step(a, b)
    expected = steps.scaled_sum.composite(ops, a, b, alpha=0.9, beta=0.1) + a
    assert got.shape == (784, 512)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
