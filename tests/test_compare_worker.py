"""The comparison worker's model options that experiments rely on."""

from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import compare_worker  # noqa: E402


def test_the_keras_layout_is_torchs_linear_with_its_weight_and_gradient_transposed():
    """``--layout keras`` must change where a layer's entries lie and nothing else: the same
    function as ``torch.nn.Linear``, its gradient the transpose of Linear's (Keras's kernel)."""
    import torch

    torch.manual_seed(0)
    linear = torch.nn.Linear(5, 3)
    keras = compare_worker._keras_dense()(5, 3)
    with torch.no_grad():
        keras.weight.copy_(linear.weight.T)
        keras.bias.copy_(linear.bias)
    x = torch.randn(4, 5)
    assert keras.weight.shape == (5, 3)  # (inputs, outputs), as Keras's Dense kernel
    np.testing.assert_allclose(keras(x).detach().numpy(), linear(x).detach().numpy(), rtol=1e-6)
    (keras(x) ** 2).sum().backward()
    (linear(x) ** 2).sum().backward()
    np.testing.assert_allclose(keras.weight.grad.numpy(), linear.weight.grad.numpy().T, rtol=1e-5)
    np.testing.assert_allclose(keras.bias.grad.numpy(), linear.bias.grad.numpy(), rtol=1e-5)
