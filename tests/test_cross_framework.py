"""The same gradient through the PyTorch and the TensorFlow adapter: the same payload bytes and the
same decompressed tensor, bit for bit (random-k given the same seed)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import torch

import grace
from grace.backends import InProcessGroup, NumpyOps

PIPELINES = {name: (lambda name=name: grace.build(name, min_numel=0)) for name in grace.available()}
PIPELINES["randomk_scaled"] = lambda: grace.randomk(0.03, seed=11, scale=True)
PIPELINES["topk"] = lambda: grace.topk(0.03)
PIPELINES["dgc"] = lambda: grace.dgc(0.03, sample_ratio=0.2)
# Sparse payloads list their selection in an order of each framework's choosing.
SELECTIONS = {"topk": (0, 1), "dgc": (0, 1)}


def as_bytes(x):
    return comparable(x).tobytes()


def comparable(x):
    """A numpy array; bfloat16 as its bits (int16)."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy()
    if isinstance(x, tf.Tensor) and x.dtype == tf.bfloat16:
        return tf.bitcast(x, tf.int16).numpy()
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def payload_bytes(payload):
    return [as_bytes(p) for p in payload]


def in_index_order(payload, name):
    """top-k's selection is one set, which each framework lists in its own order."""
    if name not in SELECTIONS:
        return payload
    v, i = SELECTIONS[name]
    values, indices = (np.asarray(payload[k]) for k in (v, i))
    order = np.argsort(indices)
    return [values[order], indices[order]]


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_torch_and_tensorflow_agree(name, dtype):
    x = np.random.default_rng(7).standard_normal((40, 50)).astype(dtype)
    torch_p, tf_p = PIPELINES[name](), PIPELINES[name]()
    torch_group, tf_group = InProcessGroup(1), InProcessGroup(1)
    for step in range(3):  # stochastic compressors draw anew each step, the same in both
        t, f = torch.from_numpy(x * (step + 1)), tf.constant(x * (step + 1))
        if name == "powersgd":
            # QR and matrix products round differently in each framework's kernels: equal to 1e-5,
            # or to one step of the output's dtype, which such a difference may cross when rounding.
            out_t = torch_p.reduce(t, "layer.weight", torch_group.worker(0)).numpy()
            out_f = tf_p.reduce(f, "layer.weight", tf_group.worker(0)).numpy()
            rtol = max(1e-5, float(np.finfo(out_t.dtype).eps))
            np.testing.assert_allclose(out_t, out_f, rtol=rtol, atol=1e-5 * np.abs(out_t).max())
            continue
        p_torch, ctx_torch = torch_p.compressor.compress(t, "layer.weight")
        p_tf, ctx_tf = tf_p.compressor.compress(f, "layer.weight")
        out_torch = torch_p.compressor.decompress(p_torch, ctx_torch)
        out_tf = tf_p.compressor.decompress(p_tf, ctx_tf)
        assert out_tf.dtype.name == dtype and tuple(out_tf.shape) == x.shape
        if dtype == "float64":
            # Sums of float64 tensors may differ in their last bits between frameworks (their own
            # summation orders); everything else, indices and packed bits included, is identical.
            for a, b in zip(in_index_order(p_torch, name), in_index_order(p_tf, name)):
                a, b = comparable(a), comparable(b)
                if a.dtype.kind == "f":
                    np.testing.assert_array_max_ulp(a, b, maxulp=4)
                else:
                    assert a.tobytes() == b.tobytes()
            np.testing.assert_array_max_ulp(out_torch.numpy(), out_tf.numpy(), maxulp=4)
            continue
        assert payload_bytes(in_index_order(p_torch, name)) == payload_bytes(in_index_order(p_tf, name))
        assert as_bytes(out_torch) == as_bytes(out_tf)


def test_tensorflow_ops_inside_tf_function_match_eager():
    pipeline = grace.topk(0.05, min_numel=0)
    x = tf.constant(np.random.default_rng(8).standard_normal(500).astype(np.float32))

    @tf.function
    def roundtrip(t):
        payload, ctx = pipeline.compressor.compress(t, "w")
        return pipeline.compressor.decompress(payload, ctx)

    eager = pipeline.compressor.decompress(*pipeline.compressor.compress(x, "w"))
    np.testing.assert_array_equal(roundtrip(x).numpy(), eager.numpy())


def test_bad_input_fails_at_construction_in_tensorflow_code():
    import horovod.tensorflow as hvd

    from frameworks.tensorflow.tape import DistributedGradientTape

    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        grace.topk(1.5)
    with pytest.raises(ValueError, match="cannot carry 'topk'"):
        grace.topk(0.1, communicator="allreduce")
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        DistributedGradientTape(tf.GradientTape(), compression=grace.topk(0.1), op=hvd.Adasum)
    assert NumpyOps().dtype(np.zeros(1, np.float32)) == "float32"
