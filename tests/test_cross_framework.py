"""The same gradient through the PyTorch and the TensorFlow adapter: the same payload bytes and the
same decompressed tensor, bit for bit (random-k given the same seed)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import torch

import grace
from grace.backends import NumpyOps

PIPELINES = {
    "none": lambda: grace.none(),
    "fp16": lambda: grace.fp16(),
    "topk": lambda: grace.topk(0.03),
    "randomk": lambda: grace.randomk(0.03, seed=11),
    "randomk_scaled": lambda: grace.randomk(0.03, seed=11, scale=True),
}


def payload_bytes(payload):
    return [np.asarray(p.numpy() if hasattr(p, "numpy") else p).tobytes() for p in payload]


def in_index_order(payload, name):
    """top-k's selection is one set, which each framework lists in its own order."""
    if name != "topk":
        return payload
    values, indices = (np.asarray(p) for p in payload)
    order = np.argsort(indices)
    return [values[order], indices[order]]


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_and_tensorflow_agree(name, dtype):
    x = np.random.default_rng(7).standard_normal((40, 50)).astype(dtype)
    torch_c, tf_c = PIPELINES[name]().compressor, PIPELINES[name]().compressor
    for step in range(3):  # random-k draws new indices each step, the same in both
        p_torch, ctx_torch = torch_c.compress(torch.from_numpy(x * (step + 1)), "layer.weight")
        p_tf, ctx_tf = tf_c.compress(tf.constant(x * (step + 1)), "layer.weight")
        assert payload_bytes(in_index_order(p_torch, name)) == payload_bytes(in_index_order(p_tf, name))
        out_torch = torch_c.decompress(p_torch, ctx_torch)
        out_tf = tf_c.decompress(p_tf, ctx_tf)
        assert out_torch.numpy().tobytes() == out_tf.numpy().tobytes()
        assert out_tf.dtype.name == dtype and tuple(out_tf.shape) == x.shape


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
