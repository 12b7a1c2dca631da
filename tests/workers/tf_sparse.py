"""Worker for tests/test_sparse_workers.py: sparse gradients (``tf.IndexedSlices``, from ``tf.gather``
and Keras's ``Embedding``) through grace's TensorFlow wrappers, on real workers.

    horovodrun -np 2 python tests/workers/tf_sparse.py OUTDIR

Writes OUTDIR/rank{r}.json with what each scenario measured; the test asserts on it."""

from __future__ import annotations

import json
import os
import sys

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import keras
import numpy as np
import tensorflow as tf

import grace
from frameworks.tensorflow import CompressionState
from tests.workers.sparse_model import (
    BAG,
    BATCH,
    CLASSES,
    LR,
    POSITION,
    TABLE,
    WIDTH,
    batch,
    initial_weights,
    numpy_run,
)

outdir = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
report: dict = {}
WEIGHTS = tf.constant(POSITION.astype(np.float32).reshape(1, BAG, 1))


def variables():
    table, linear = initial_weights()
    return tf.Variable(table, name="embedding"), tf.Variable(linear, name="linear")


def loss_of(E, W, x, t):
    h = tf.reduce_sum(tf.gather(E, x) * WEIGHTS, 1)
    return tf.reduce_mean((tf.matmul(h, W, transpose_b=True) - t) ** 2)


def tape_run(compression, steps: int, graph: bool, resume_at: int | None = None):
    E, W = variables()
    kinds = []
    state = CompressionState(compression) if hasattr(compression, "stats") else None

    def step(x, t):
        with tf.GradientTape() as tape:
            loss = loss_of(E, W, x, t)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, [E, W])
        kinds.append(type(grads[0]).__name__)
        E.scatter_sub(tf.IndexedSlices(LR * grads[0].values, grads[0].indices))
        W.assign_sub(LR * grads[1])

    run = tf.function(step) if graph else step
    for s in range(steps):
        if s == resume_at:  # as a new process would: new variables and pipeline, the checkpoint read
            path = tf.train.Checkpoint(E=E, W=W, compression=state).write(
                os.path.join(outdir, f"ckpt{rank}"))
            compression = grace.topk(0.05)
            E, W = variables()
            state = CompressionState(compression)
            tf.train.Checkpoint(E=E, W=W, compression=state).read(path).assert_consumed()
            run = tf.function(step) if graph else step
        run(*(tf.constant(a) for a in batch(s, rank)))
    return E.numpy().astype(np.float64), W.numpy().astype(np.float64), kinds


def gap(a, b):
    return float(np.abs(a - b).max())


def compare(key, compression, steps, graph, reference):
    E, W, kinds = tape_run(compression, steps, graph)
    report[key] = {"gap": max(gap(E, reference[0]), gap(W, reference[1])), "kinds": sorted(set(kinds))}
    if hasattr(compression, "stats"):
        report[key]["stats"] = compression.stats()
    return E, W


def fp16_rows():
    """fp16 on the table's rows, the dense layer (64 elements) left in float32 (``min_numel`` as
    before fp16's default became 0): the tests bound the rows' float16 rounding."""
    return grace.fp16(min_numel=1024)


none_ref, topk_ref = numpy_run(5, None, size), numpy_run(5, 0.05, size)
for graph in (False, True):
    mode = "function" if graph else "eager"
    compare(f"tape.{mode}.none", grace.none(), 5, graph, none_ref)
    compare(f"tape.{mode}.horovod", hvd.Compression.none, 5, graph, none_ref)
    compare(f"tape.{mode}.fp16", fp16_rows(), 5, graph, none_ref)
for graph in (False, True):
    mode = "function" if graph else "eager"
    compare(f"tape.{mode}.topk", grace.topk(0.05), 5, graph, topk_ref)
    full = tape_run(grace.topk(0.05), 8, graph)
    resumed = tape_run(grace.topk(0.05), 8, graph, resume_at=4)
    report[f"resume.{mode}"] = max(gap(full[0], resumed[0]), gap(full[1], resumed[1]))


# --- TF1 optimizer --------------------------------------------------------------------------------
def legacy_run(compression):
    E, W = variables()
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR), compression=compression)
    for s in range(5):
        x, t = (tf.constant(a) for a in batch(s, rank))
        opt.minimize(lambda: loss_of(E, W, x, t), var_list=[E, W])
    return E.numpy().astype(np.float64), W.numpy().astype(np.float64)


for name, compression, reference in (("none", grace.none(), none_ref), ("topk", grace.topk(0.05), topk_ref)):
    E, W = legacy_run(compression)
    report[f"legacy.{name}"] = max(gap(E, reference[0]), gap(W, reference[1]))


# --- Keras: an Embedding layer, model.fit, SGD and Adam -------------------------------------------
def keras_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((BAG,), dtype="int32"), keras.layers.Embedding(TABLE, WIDTH),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(CLASSES)])


def keras_data(worker):
    xs, ts = zip(*(batch(s, worker) for s in range(4)))
    return np.concatenate(xs), np.concatenate(ts)


def deduplicated(optimizer):
    """``optimizer`` applying each ``tf.IndexedSlices`` gradient with its repeated rows added up,
    as grace hands it over. (Keras's Adam squares a sparse gradient row by row, repeats apart, so
    that the same gradient with repeats steps differently.)"""
    def apply(self, grads, trainable_variables=None):
        def once(g):
            if not isinstance(g, tf.IndexedSlices):
                return g
            distinct, position = tf.unique(g.indices)
            return tf.IndexedSlices(tf.math.unsorted_segment_sum(g.values, position, tf.size(distinct)),
                                    distinct, g.dense_shape)
        return super(cls, self).apply([once(g) for g in grads], trainable_variables)

    cls = type(type(optimizer).__name__, (type(optimizer),), {"apply": apply})
    return cls.from_config(optimizer.get_config())


def keras_run(optimizer, compression=None):
    """4 steps of model.fit: distributed (each worker its own batches), or, without
    ``compression``, in this process alone on both workers' batches at once (the same average)."""
    model = keras_model()
    if compression is not None:
        optimizer = hvd_keras.DistributedOptimizer(optimizer, compression=compression)
        x, t = keras_data(rank)
        batch_size = BATCH
    else:
        data = [keras_data(w) for w in range(size)]
        # Step s of the single model sees every worker's batch s.
        steps = [slice(s * BATCH, (s + 1) * BATCH) for s in range(4)]
        x = np.concatenate([d[0][step] for step in steps for d in data])
        t = np.concatenate([d[1][step] for step in steps for d in data])
        batch_size = BATCH * size
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, t, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return [w.numpy().astype(np.float64) for w in model.weights]


for name, make in (("sgd", lambda: keras.optimizers.SGD(0.5)), ("adam", lambda: keras.optimizers.Adam(0.01))):
    alone = keras_run(deduplicated(make()))
    for compression in ("none", "fp16"):
        together = keras_run(make(), fp16_rows() if compression == "fp16" else grace.none())
        report[f"keras.{name}.{compression}"] = max(gap(a, b) for a, b in zip(alone, together))

# Top-k on the rows inside model.fit (a traced graph: encoded by numpy when it runs).
compression = grace.topk(0.05)
weights = keras_run(keras.optimizers.Adam(0.01), compression)
report["keras.adam.topk"] = {"weights": [float(w.sum()) for w in weights], "stats": compression.stats()}

with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
