"""Worker for tests/test_reliability.py: a tape under tf.function where rank 1's gradient overflows at
step 3 and the update is skipped when the combined gradients are not finite (what a loss scaler
does). Runs ``overflow`` and ``skipped`` (step 3 left out) per compressor; saves weights and the
compression state around step 3."""

from __future__ import annotations

import math
import os
import pickle
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from tests.workers.common import LR, batch, init_weights
from tests.workers.scenarios import build, names

COMPRESSORS = {name: (lambda name=name: build(name)) for name in names("tf", "nonfinite")}
OVERFLOW_STEP = 3

outdir = sys.argv[1]
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
rank = hvd.rank()


def state_of(compression):
    state = compression.state_dict()
    return {part: {attr: {k: np.asarray(v) for k, v in entries.items()}
                   for attr, entries in state[part].items()} for part in ("compressor", "memory")}


def run(name, mode):
    w0, b0 = init_weights(0)
    w, b = tf.Variable(w0, name="weight"), tf.Variable(b0, name="bias")
    compression = COMPRESSORS[name]()

    @tf.function
    def step(x, y, poison):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w, transpose_b=True) + b - y)) * poison
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gw, gb = tape.gradient(loss, [w, b])
        finite = tf.reduce_all(tf.math.is_finite(gw)) & tf.reduce_all(tf.math.is_finite(gb))
        if finite:
            w.assign_sub(LR * gw)
            b.assign_sub(LR * gb)

    for s in range(8):
        if mode == "skipped" and s == OVERFLOW_STEP:
            continue
        if mode == "overflow" and s == OVERFLOW_STEP:
            before, w_before = state_of(compression), w.numpy()
        poison = math.inf if (mode == "overflow" and s == OVERFLOW_STEP and rank == 1) else 1.0
        step(*(tf.constant(a) for a in batch(rank, s)), tf.constant(poison, tf.float32))
        if mode == "overflow" and s == OVERFLOW_STEP:
            with open(os.path.join(outdir, f"tf_{name}.states.rank{rank}.pkl"), "wb") as f:
                pickle.dump({"before": before, "after": state_of(compression),
                             "unchanged": bool(np.array_equal(w.numpy(), w_before))}, f)
    np.savez(os.path.join(outdir, f"tf_{name}.{mode}.rank{rank}.npz"), w=w.numpy(), b=b.numpy())


for name in COMPRESSORS:
    run(name, "overflow")
    run(name, "skipped")
