"""Worker for tests/test_reliability.py: TensorFlow (tape under tf.function) checkpointed with
tf.train.Checkpoint and resumed; phases as in torch_resume.py (without ``elastic``)."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import LR, batch, init_weights  # noqa: E402

import grace  # noqa: E402
from frameworks.tensorflow.checkpoint import CompressionState  # noqa: E402

RESUMED = {
    "topk": lambda: grace.topk(0.05),
    "dgc": lambda: grace.dgc(0.05, sample_ratio=0.2),
    "powersgd": lambda: grace.powersgd(rank=2),
    "randomk": lambda: grace.randomk(0.05, seed=3),
}

outdir, phase = sys.argv[1], sys.argv[2]
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
rank = hvd.rank()

for name, make in RESUMED.items():
    w0, b0 = init_weights(0)
    w, b = tf.Variable(w0, name="weight"), tf.Variable(b0, name="bias")
    compression = make()
    checkpoint = tf.train.Checkpoint(w=w, b=b, compression=CompressionState(compression))
    path = os.path.join(outdir, f"{name}.rank{rank}")

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w, transpose_b=True) + b - y))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(LR * gw)
        b.assign_sub(LR * gb)

    first, last = {"full": (0, 10), "first": (0, 5), "second": (5, 10)}[phase]
    if phase == "second":
        checkpoint.read(path).assert_consumed()  # before the first step: variables created here
    for s in range(first, last):
        step(*(tf.constant(a) for a in batch(rank, s)))
    if phase == "first":
        checkpoint.write(path)
        continue
    np.savez(os.path.join(outdir, f"{name}.{phase}.rank{rank}.npz"), w=w.numpy(), b=b.numpy())
