"""Worker for tests/test_reliability.py: TensorFlow (tape under tf.function) checkpointed with
tf.train.Checkpoint and resumed; phases as in torch_resume.py (without ``elastic``), several of
them in one process when named together ("full,first"). The compressors are scenarios.py's."""

from __future__ import annotations

import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from frameworks.tensorflow.checkpoint import CompressionState
from tests.workers.common import LR, batch, init_weights
from tests.workers.scenarios import build, names

outdir, phases = sys.argv[1], sys.argv[2]
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
rank = hvd.rank()


def run(phase: str) -> None:
    for name in names("tf", "resume"):
        w0, b0 = init_weights(0)
        w, b = tf.Variable(w0, name="weight"), tf.Variable(b0, name="bias")
        compression = build(name)
        checkpoint = tf.train.Checkpoint(w=w, b=b, compression=CompressionState(compression))
        weights_only = tf.train.Checkpoint(w=w, b=b)  # the control: resuming without compression state
        path = os.path.join(outdir, f"{name}.rank{rank}")

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w, transpose_b=True) + b - y))
            tape = hvd.DistributedGradientTape(tape, compression=compression)
            gw, gb = tape.gradient(loss, [w, b])
            w.assign_sub(LR * gw)
            b.assign_sub(LR * gb)

        first, last = {"full": (0, 10), "first": (0, 5), "second": (5, 10), "without_state": (5, 10)}[phase]
        if phase == "second":
            checkpoint.read(path).assert_consumed()  # before the first step: variables created here
        elif phase == "without_state":
            weights_only.read(path).expect_partial()
        for s in range(first, last):
            step(*(tf.constant(a) for a in batch(rank, s)))
        if phase == "first":
            checkpoint.write(path)
            continue
        np.savez(os.path.join(outdir, f"{name}.{phase}.rank{rank}.npz"), w=w.numpy(), b=b.numpy())


# Phases named together run in one process, in order: "second" still starts from the checkpoint
# "first" wrote in another process; "full" and "without_state" share a process with no state.
for phase in phases.split(","):
    run(phase)
