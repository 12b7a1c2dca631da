"""Keras's kernels handed to the compressors in PyTorch's order.

Keras keeps a layer's outputs on a kernel's last axis (``Dense``: (inputs, outputs); ``Conv2D``:
(height, width, inputs, outputs); ``LSTM``: (inputs, 4 · units)); PyTorch keeps them on the first
(``Linear``: (outputs, inputs); ``Conv2d``: (outputs, inputs, height, width); ``LSTM``: (4 ·
hidden, inputs)). A compressor that scales blocks of consecutive elements (1-bit SGD, EF-signSGD,
QSGD) or views a tensor as a matrix (PowerSGD) therefore groups other elements in TensorFlow than in
PyTorch: a block of one output's fan-in in PyTorch, of one input's fan-out in Keras. After ReLU a
weight's gradient ``x_i · δ_j`` takes its sign from the output's ``δ_j``, so the fan-in is the
block whose two means 1-bit SGD reproduces well: measured on mnist with Adam, PyTorch with its
layers stored as Keras's kernels loses what TensorFlow loses (2.3 and 2.1 points against 0.0,
docs/quality.md), and a Keras Conv2D kernel's matrix view has as few rows as the kernel is high.
So for a compressor that is ``layout_sensitive`` the TensorFlow wrappers move a kernel's last axis
to the front before compression and back after. A kernel is told by its name (Keras names them
``kernel`` and ``recurrent_kernel``); other variables, embeddings among them (rows of a table in
both frameworks), are compressed as they lie."""

from __future__ import annotations

import tensorflow as tf

KERNEL_NAMES = ("kernel", "recurrent_kernel")


def is_output_last(name: str, rank: int) -> bool:
    """Whether the variable called ``name`` (``variable_name``'s) is a Keras kernel of 2 or more
    axes, whose outputs lie on the last axis."""
    return rank >= 2 and name.rsplit("/", 1)[-1] in KERNEL_NAMES


def output_major(gradient: tf.Tensor) -> tf.Tensor:
    """A kernel's gradient with its last axis moved to the front (PyTorch's order)."""
    rank = gradient.shape.rank
    return tf.transpose(gradient, [rank - 1, *range(rank - 1)])


def output_last(gradient: tf.Tensor) -> tf.Tensor:
    """``output_major`` undone: the first axis moved back to the end."""
    rank = gradient.shape.rank
    return tf.transpose(gradient, [*range(1, rank), 0])
