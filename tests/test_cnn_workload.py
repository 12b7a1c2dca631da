"""The ``cnn`` workload (scripts/cnn.py): the same network in PyTorch and in Keras, built from
``workloads.CNN``'s numbers, and judged as an image model by the quality benchmark."""

from __future__ import annotations

import numpy as np
import pytest

from scripts import cnn, quality, workloads

PARAMETERS = 1_688_378  # the count cnn.py's docstring states


def torch_shapes() -> list[tuple[int, ...]]:
    model = cnn.torch_model(workloads.CNN)
    return [tuple(p.shape) for p in model.parameters()]


def keras_shapes_in_torch_layout() -> list[tuple[int, ...]]:
    """Keras's trainable variables, each in PyTorch's layout: a convolution's kernel (kh, kw, in,
    out) as (out, in, kh, kw), a dense kernel (in, out) as (out, in)."""
    model = cnn.keras_model(workloads.CNN)
    shapes = []
    for v in model.trainable_variables:
        shape = tuple(v.shape)
        if len(shape) == 4:
            shape = (shape[3], shape[2], shape[0], shape[1])
        elif len(shape) == 2:
            shape = (shape[1], shape[0])
        shapes.append(shape)
    return shapes


def test_both_frameworks_build_the_same_tensors():
    t = torch_shapes()
    k = keras_shapes_in_torch_layout()
    assert sorted(t) == sorted(k) and len(t) == 31  # 9 convolutions x 3, 2 dense x 2
    assert sum(int(np.prod(s)) for s in t) == PARAMETERS
    # three basic blocks: 1 + 2 + 3 + 3 convolutions, each with batch norm's scale and shift
    assert sum(len(s) == 4 for s in t) == 9
    assert t[-4:] == [(512, 64 * 7 * 7), (512,), (10, 512), (10,)]


def test_both_frameworks_classify_a_batch_of_images():
    import keras
    import torch

    images = np.random.default_rng(0).standard_normal((3, 28, 28), np.float32)
    torch_out = cnn.torch_model(workloads.CNN)(torch.from_numpy(images[:, None]))
    keras_out = cnn.keras_model(workloads.CNN)(images[..., None], training=False)
    assert tuple(torch_out.shape) == tuple(keras.ops.shape(keras_out)) == (3, 10)


def test_the_quality_benchmark_judges_it_in_accuracy_points():
    def run(compression, accuracy):
        epochs = [{"epoch": 1, "test_accuracy": accuracy, "train_wall_s": 1.0}]
        return {"workload": "cnn", "optimizer": "sgd", "framework": "torch", "compression": compression,
                "seed": 0, "status": "ok", "epochs": epochs, "bytes_per_step": 1, "step_s": 0.01}

    rows = quality.summarize([run("fp32", 0.905), run('{"compressor": "qsgd"}', 0.89)])
    qsgd = next(r for r in rows if r["compressor"] == "qsgd")
    assert (qsgd["gap"], qsgd["target"], qsgd["met"]) == (pytest.approx(1.5), 2.0, True)
    assert "gap (points)" in quality.markdown(rows)
    assert (quality.CASES["cnn-sgd"], quality.CASES["cnn-adam"]) == (("cnn", "sgd"), ("cnn", "adam"))
    epochs, steps = quality.BUDGET["cnn"]
    assert epochs * steps * 2 * workloads.CNN["batch"] == pytest.approx(2 * 60_000, rel=0.01)  # 2 passes
    assert not quality.is_accuracy("lstm") and quality.is_accuracy("mnist")
    # the sign methods' rate: as on the MLP, whose SGD has the same momentum
    for name in ("signsgd", "signum"):
        assert quality.learning_rate(name, "cnn", "sgd") == quality.learning_rate(name, "mnist", "sgd")


def test_batch_norm_has_pytorchs_settings_in_keras():
    import keras

    norms = [layer for layer in cnn.keras_model(workloads.CNN).layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 9
    assert {(n.momentum, n.epsilon) for n in norms} == {(0.9, 1e-5)}
    import torch

    torch_norms = [m for m in cnn.torch_model(workloads.CNN).modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(torch_norms) == 9 and {(m.momentum, m.eps) for m in torch_norms} == {(0.1, 1e-5)}
