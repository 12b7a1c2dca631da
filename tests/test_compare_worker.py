"""The comparison worker's model options that experiments rely on."""

from __future__ import annotations

import numpy as np

from scripts import compare_worker


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


def test_tensorflows_exchange_loss_hands_the_tape_its_fixed_gradients_as_they_are():
    """The exchange workload's TensorFlow loss must give each variable exactly its fixed gradient
    (bit for bit, as PyTorch's ``p.grad = g.clone()``), traced and eager, and compute nothing:
    its traced gradient holds no multiplication over the variables."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    fixed = [tf.constant(rng.standard_normal(s, np.float32)) for s in [(3, 4), (7,), (2, 2, 2)]]
    variables = [tf.Variable(tf.ones(g.shape)) for g in fixed]

    def gradients():
        with tf.GradientTape() as tape:
            loss = compare_worker.exchange_loss(variables, fixed)
        return loss, tape.gradient(loss, variables)

    traced = tf.function(gradients)
    for loss, grads in [gradients(), traced()]:
        assert float(loss) == 0.0
        for got, want in zip(grads, fixed):
            np.testing.assert_array_equal(got.numpy(), want.numpy())
    ops = {node.op for node in traced.get_concrete_function().graph.as_graph_def().node}
    assert "Mul" not in ops


def test_keras_initialization_of_the_lstm_is_keras_defaults():
    """``--init glorot`` on the character LSTM: the embedding uniform in ±0.05; the input weights
    Glorot-uniform over the whole (4 · hidden, inputs) matrix (Keras draws its (inputs, 4 · units)
    kernel whole), so within sqrt(6 / (inputs + 4 · hidden)) and spread to near it; the recurrent
    weights orthogonal; the biases zero but the forget gate's (PyTorch's second quarter), which is
    1 once, not twice over PyTorch's two bias vectors; the output layer Glorot-uniform, zero bias."""
    import torch

    torch.manual_seed(0)
    embed, lstm, out = torch.nn.Embedding(65, 32), torch.nn.LSTM(32, 128), torch.nn.Linear(128, 65)
    compare_worker.keras_init_lstm(embed, lstm, out)
    with torch.no_grad():
        assert 0.045 < float(embed.weight.abs().max()) <= 0.05
        bound = (6 / (32 + 4 * 128)) ** 0.5
        assert 0.95 * bound < float(lstm.weight_ih_l0.abs().max()) <= bound
        w = lstm.weight_hh_l0  # (4 * hidden, hidden): orthonormal columns
        np.testing.assert_allclose((w.T @ w).numpy(), np.eye(128), atol=1e-5)
        bias = (lstm.bias_ih_l0 + lstm.bias_hh_l0).numpy()
        np.testing.assert_array_equal(bias, np.r_[np.zeros(128), np.ones(128), np.zeros(256)])
        out_bound = (6 / (128 + 65)) ** 0.5
        assert 0.9 * out_bound < float(out.weight.abs().max()) <= out_bound
        assert not out.bias.any()


def test_keras_initialization_of_the_word_model_is_keras_defaults():
    """``--init glorot`` on the word model: the sparse embedding uniform in ±0.05 (PyTorch's own is
    a unit normal), both dense layers Glorot-uniform within sqrt(6 / (fan_in + fan_out)) and spread
    to near it, their biases zero."""
    import torch

    torch.manual_seed(0)
    model = compare_worker.torch_word_model("glorot")  # as the worker builds it with --init glorot
    embed, hidden, out = model.embed, model.hidden, model.out
    assert embed.sparse and (embed.num_embeddings, embed.embedding_dim) == (4096, 64)
    assert float(compare_worker.torch_word_model().embed.weight.abs().max()) > 1  # PyTorch's own
    with torch.no_grad():
        assert 0.049 < float(embed.weight.abs().max()) <= 0.05
        assert abs(float(embed.weight.std()) - 0.05 / 3 ** 0.5) < 0.001  # uniform, not a normal
        for layer, fans in ((hidden, 512 + 256), (out, 256 + 4096)):
            bound = (6 / fans) ** 0.5
            assert 0.99 * bound < float(layer.weight.abs().max()) <= bound
            assert not layer.bias.any()
