"""The compressor API's former method names (``encode``, ``decode``, ``combine``,
``decoded_residual``: near-synonyms of ``compress``, ``aggregate`` and ``residual``) keep working
for a compressor written against them and for a caller of them, with one ``FutureWarning`` a
process each, and give the same bits as the names they now have."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import grace
from grace import compressor as base
from grace.backends import InProcessGroup, NumpyOps
from grace.communicators import Allgather
from grace.compressor import RENAMED_METHODS, Compressor
from grace.compressors import TopK
from grace.memories import ResidualMemory

OPS = NumpyOps()


def _future_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def _half_precision(calls: list[str] | None):
    """A codec that rounds to float16 (lossy, so its residual is not zero), written against the
    former names when ``calls`` records them, else against the current ones."""
    if calls is None:
        class Current(Compressor):
            name = "half"

            def compress_flat(self, flat, name, ctx, ops):
                return [ops.cast(flat, "float16")]

            def decompress_flat(self, payload, ctx, ops):
                return ops.cast(payload[0], ctx.dtype)
        return Current()

    class Former(Compressor):
        name = "half"

        def encode(self, flat, name, ctx, ops):
            calls.append("encode")
            return [ops.cast(flat, "float16")]

        def decode(self, payload, ctx, ops):
            calls.append("decode")
            return ops.cast(payload[0], ctx.dtype)

        def combine(self, payloads, ctx, ops, scale=1.0):
            calls.append("combine")
            total = self.aggregate([self.decompress(p, ctx, ops) for p in payloads], ops)
            return ops.scale(total, scale) if scale != 1.0 else total

        def decoded_residual(self, compensated, payload, ctx, ops, overwrite=False):
            calls.append("decoded_residual")
            return ops.sub(compensated, self.decompress(payload, ctx, ops))
    return Former()


def test_a_compressor_written_against_the_former_names_trains_as_the_current_one(monkeypatch):
    monkeypatch.setattr(base, "_warned_renamed", set())
    calls: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        former = _half_precision(calls)
    said = _future_warnings(caught)
    assert sorted(said) == sorted(f"grace: Compressor.{old} is now called {new} (Former defines "
                                  f"{old}); the former name will go in a later release"
                                  for old, new in RENAMED_METHODS.items())
    current = _half_precision(None)

    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(300).astype(np.float32) * 1e-3 for _ in range(3)]
    outs, residuals = {}, {}
    for label, compressor in (("former", former), ("current", current)):
        pipeline = grace.Pipeline(compressor, ResidualMemory(), Allgather(), min_numel=0)
        worker = InProcessGroup(1).worker(0)
        outs[label] = [pipeline.reduce(g, "w", worker) for g in grads]
        residuals[label] = pipeline.memory.residuals["w"].copy()
    # The steps are lossy (float16 of values near 1e-3), so equal outputs and residuals mean the
    # former class's methods ran where the current names are called.
    assert np.any(residuals["current"] != 0)
    for got, want in zip(outs["former"], outs["current"]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(residuals["former"], residuals["current"])
    assert {"encode", "decode", "combine", "decoded_residual"} <= set(calls)


def test_calling_a_former_name_warns_once_and_gives_the_current_result(monkeypatch):
    monkeypatch.setattr(base, "_warned_renamed", set())
    topk = TopK(0.1)
    x = np.random.default_rng(5).standard_normal(200).astype(np.float32)
    payload, ctx = topk.compress(x, "w", OPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second call says nothing more
            encoded = topk.encode(x, "w", ctx, OPS)
            decoded = topk.decode(encoded, ctx, OPS)
            combined = topk.combine([encoded, payload], ctx, OPS, 0.5)
    assert sorted(_future_warnings(caught)) == sorted(
        f"grace: Compressor.{old} is now called {RENAMED_METHODS[old]} (called); the former name "
        f"will go in a later release" for old in ("encode", "decode", "combine"))
    for got, want in zip(encoded, topk.compress_flat(x, "w", ctx, OPS)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(decoded, topk.decompress_flat(payload, ctx, OPS))
    np.testing.assert_array_equal(combined, topk.aggregate_payloads([payload, payload], ctx, OPS, 0.5))


def test_a_former_decoded_residual_keeps_its_meaning_beside_sent_entries(monkeypatch):
    """``decoded_residual`` was the residual of a payload that does not send entries as they are:
    a sparsifier that defined it still zeroes its sent entries, and never calls it."""
    monkeypatch.setattr(base, "_warned_renamed", set())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)

        class FormerTopK(TopK):
            def decoded_residual(self, compensated, payload, ctx, ops, overwrite=False):
                raise AssertionError("a payload of sent entries has no decoded residual")

    x = np.random.default_rng(7).standard_normal(200).astype(np.float32)
    for codec in (FormerTopK(0.1), TopK(0.1)):
        payload, ctx = codec.compress(x, "w", OPS)
        left = codec.residual(x.copy(), payload, ctx, OPS)
        kept = np.flatnonzero(left == 0)
        assert len(kept) == 20 and np.array_equal(np.delete(left, kept), np.delete(x, kept))


def test_an_unknown_method_is_not_taken_for_a_former_name():
    """Only the four former names are mapped: a compressor without ``compress_flat`` (nor
    ``encode``) stays abstract."""
    class Incomplete(Compressor):
        name = "incomplete"

        def decompress_flat(self, payload, ctx, ops):
            return payload[0]

    with pytest.raises(TypeError, match="compress_flat"):
        Incomplete()


def test_a_former_subclass_of_a_catalogue_compressor_reaches_its_parent_through_super(monkeypatch):
    """``super().encode(...)`` in a subclass of top-k written against the former names (scaling
    the tensor before top-k's own encoding, say) reaches top-k's ``compress_flat``, not its own
    method again; likewise ``decode``, ``combine`` and ``decoded_residual``."""
    monkeypatch.setattr(base, "_warned_renamed", set())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)

        class Doubled(TopK):
            def encode(self, flat, name, ctx, ops):
                return super().encode(ops.scale(flat, 2.0), name, ctx, ops)

            def decode(self, payload, ctx, ops):
                return ops.scale(super().decode(payload, ctx, ops), 0.5)

            def combine(self, payloads, ctx, ops, scale=1.0):
                return super().combine(payloads, ctx, ops, scale * 0.5)

    x = np.random.default_rng(9).standard_normal(200).astype(np.float32)
    doubled, plain = Doubled(0.1), TopK(0.1)
    payload, ctx = doubled.compress(x, "w", OPS)
    want, want_ctx = plain.compress(2 * x, "w", OPS)
    for got, expected in zip(payload, want):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(doubled.decompress(payload, ctx, OPS),
                                  0.5 * plain.decompress(want, want_ctx, OPS))
    np.testing.assert_array_equal(doubled.aggregate_payloads([payload, payload], ctx, OPS),
                                  0.5 * plain.aggregate_payloads([want, want], want_ctx, OPS))
    # A former name called on it directly runs its own method, which reaches top-k's once.
    for got, expected in zip(doubled.encode(x, "w", ctx, OPS), want):
        np.testing.assert_array_equal(got, expected)


def test_a_class_that_defines_both_names_keeps_its_current_method(monkeypatch):
    """Only a former name without the current one beside it is taken as the current one."""
    monkeypatch.setattr(base, "_warned_renamed", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Both(TopK):
            def encode(self, flat, name, ctx, ops):
                raise AssertionError("the current compress_flat is the one to run")

            def compress_flat(self, flat, name, ctx, ops):
                return super().compress_flat(flat, name, ctx, ops)

    assert _future_warnings(caught) == []
    x = np.random.default_rng(11).standard_normal(200).astype(np.float32)
    for got, expected in zip(Both(0.1).compress(x, "w", OPS)[0], TopK(0.1).compress(x, "w", OPS)[0]):
        np.testing.assert_array_equal(got, expected)


def test_calling_the_former_decoded_residual_gives_the_decoded_difference(monkeypatch):
    """``decoded_residual`` called on any compressor is what it was: the compensated tensor less
    the decoded payload, whether or not the payload sends entries as they are."""
    monkeypatch.setattr(base, "_warned_renamed", set())
    x = np.random.default_rng(13).standard_normal(200).astype(np.float32)
    for codec in (TopK(0.1), _half_precision(None)):
        payload, ctx = codec.compress(x, "w", OPS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            left = codec.decoded_residual(x, payload, ctx, OPS)
        np.testing.assert_array_equal(left, x - codec.decompress(payload, ctx, OPS))
        np.testing.assert_array_equal(left, codec.residual(x.copy(), payload, ctx, OPS))
    assert len(_future_warnings(caught)) == 0  # said once, at the first codec
