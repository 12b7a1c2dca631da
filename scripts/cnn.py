"""The ``cnn`` workload's network, built from ``workloads.CNN``'s numbers in PyTorch and in Keras: a
small residual network for 28x28 Fashion-MNIST images (He et al., "Deep Residual Learning for Image
Recognition", CVPR 2016, in the basic-block form of its CIFAR networks).

A 3x3 convolution to 16 channels with batch norm, three basic blocks (two 3x3 convolutions with
batch norm; the second and third halve the image with a stride of 2 and widen it to 32 and 64
channels, their shortcut a strided 1x1 convolution with batch norm), then a dense layer of 512 and
the 10-way classifier: 1,688,378 trainable parameters in both frameworks, the same tensors up to each
framework's layout (PyTorch's out x in x kh x kw, Keras's kh x kw x in x out) and order (Keras lists a
block's shortcut before its second convolution), batch norm with PyTorch's settings in both (running
averages at 0.9, epsilon 1e-5).
Its dense layer holds most of the parameters and the convolutions most of the compute: one CPU
core's step (batch 64, ~45 ms) meets about the time a 1 Gbit/s link takes for its fp32 exchange,
where compression matters.
"""

from __future__ import annotations


def torch_model(cfg: dict):
    """The network as a ``torch.nn.Sequential`` over NCHW images (N, 1, 28, 28)."""
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, inputs: int, outputs: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.shortcut = None
            if stride != 1 or inputs != outputs:
                self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                              nn.BatchNorm2d(outputs))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu(y + (x if self.shortcut is None else self.shortcut(x)))

    first, *rest = cfg["widths"]
    layers: list = [nn.Conv2d(1, first, 3, 1, 1, bias=False), nn.BatchNorm2d(first), nn.ReLU(),
                    BasicBlock(first, first, 1)]
    width = first
    for w in rest:
        layers.append(BasicBlock(width, w, 2))
        width = w
    side = cfg["image"] // 2 ** len(rest)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(width * side * side, cfg["hidden"]), nn.ReLU(),
                         nn.Linear(cfg["hidden"], 10))


def keras_model(cfg: dict):
    """The network as a functional ``keras.Model`` over NHWC images (N, 28, 28, 1)."""
    import keras

    layers = keras.layers

    def conv_bn(x, outputs: int, size: int, stride: int):
        # PyTorch's batch-norm defaults: running averages at 0.9 (Keras's 0.99 lags a quarter pass)
        return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(
            layers.Conv2D(outputs, size, stride, padding="same", use_bias=False)(x))

    def basic_block(x, outputs: int, stride: int):
        y = conv_bn(layers.ReLU()(conv_bn(x, outputs, 3, stride)), outputs, 3, 1)
        shortcut = x if stride == 1 and x.shape[-1] == outputs else conv_bn(x, outputs, 1, stride)
        return layers.ReLU()(layers.Add()([y, shortcut]))

    first, *rest = cfg["widths"]
    inputs = keras.Input((cfg["image"], cfg["image"], 1))
    x = basic_block(layers.ReLU()(conv_bn(inputs, first, 3, 1)), first, 1)
    for w in rest:
        x = basic_block(x, w, 2)
    x = layers.Dense(cfg["hidden"], activation="relu")(layers.Flatten()(x))
    return keras.Model(inputs, layers.Dense(10)(x))
