"""Worker for tests/test_horovod_tensorflow.py: trains common.py's linear model with TensorFlow and
Horovod under several configurations; saves each rank's final weights and compression stats.

Run by ``horovodrun -np 2 python tests/workers/tf_train.py OUTDIR [--scenarios a,b]``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvd_keras  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import BATCH, CATALOGUE_LR, LR, batch, init_weights  # noqa: E402

import grace  # noqa: E402
from frameworks.tensorflow.keras import BroadcastGlobalVariablesCallback  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("--scenarios", default="all")
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
rank = hvd.rank()


def save(name, w, b, stats=None, **info):
    np.savez(os.path.join(args.outdir, f"{name}.rank{rank}.npz"), w=np.asarray(w), b=np.asarray(b))
    with open(os.path.join(args.outdir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump({"stats": stats, **info}, f)


def variables():
    w, b = init_weights(0)
    return tf.Variable(w, name="weight"), tf.Variable(b, name="bias")


def loss_of(w, b, x, y):
    return tf.reduce_mean(tf.square(tf.matmul(x, w, transpose_b=True) + b - y))


def tape_training(name, compression, use_function, lr=LR, op=hvd.Average, groups=None):
    w, b = variables()
    traces = []

    def step(x, y):
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = loss_of(w, b, x, y)
        tape = hvd.DistributedGradientTape(tape, compression=compression, op=op, groups=groups)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(lr * gw)
        b.assign_sub(lr * gb)

    run = tf.function(step) if use_function else step
    for s in range(args.steps):
        run(*(tf.constant(a) for a in batch(rank, s)))
    save(name, w.numpy(), b.numpy(), compression.stats(), traces=len(traces))


def legacy_optimizer(name, compression, momentum=0.0):
    w, b = variables()
    base = tf.compat.v1.train.MomentumOptimizer(LR, momentum) if momentum else \
        tf.compat.v1.train.GradientDescentOptimizer(LR)
    opt = hvd.DistributedOptimizer(base, compression=compression)
    for s in range(args.steps):
        x, y = (tf.constant(a) for a in batch(rank, s))
        opt.minimize(lambda: loss_of(w, b, x, y), var_list=[w, b])
    save(name, w.numpy(), b.numpy(), compression.stats())


class GraceLog(logging.Handler):
    """The lines grace logs while a scenario builds its wrapper, kept for the test to read."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def keras_fit(name, compression, different_start=True, momentum=0.0, accumulate=None, adam=False):
    w, b = init_weights(0)
    log = GraceLog()
    logging.getLogger("grace").addHandler(log)
    model = keras.Sequential([keras.Input((w.shape[1],)), keras.layers.Dense(w.shape[0])])
    start = 0.0 if rank == 0 or not different_start else 1.0  # rank 0's weights are broadcast
    model.layers[0].set_weights([w.T + start, b + start])
    # Keras divides an accumulated sum by its steps: twice the rate gives the sum's update.
    base = keras.optimizers.Adam(0.01) if adam else keras.optimizers.SGD(
        LR * (accumulate or 1), momentum=momentum, gradient_accumulation_steps=accumulate)
    opt = hvd_keras.DistributedOptimizer(base, compression=compression)
    logging.getLogger("grace").removeHandler(log)
    model.compile(optimizer=opt, loss="mse")  # every other option left at its default
    micro_steps = args.steps * (accumulate or 1)
    x = np.concatenate([batch(rank, s)[0] for s in range(micro_steps)])
    y = np.concatenate([batch(rank, s)[1] for s in range(micro_steps)])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    kernel, bias = model.layers[0].get_weights()
    stats = compression.stats() if isinstance(compression, grace.Pipeline) else None
    setting = {"optimizer_beta_1": float(model.optimizer.beta_1)} if adam else {
        "optimizer_momentum": float(model.optimizer.momentum)}
    save(name, kernel.T, bias, stats, jit_compile=bool(model.jit_compile), grace_log=log.lines,
         kernel_path=model.layers[0].kernel.path, **setting)


scenarios = {
    "tape_eager_topk": lambda: tape_training("tape_eager_topk", grace.topk(0.05), False),
    "tape_function_topk": lambda: tape_training("tape_function_topk", grace.topk(0.05), True),
    "tape_eager_topk_alltoall": lambda: tape_training(
        "tape_eager_topk_alltoall", grace.topk(0.05, communicator="alltoall"), False),
    "tape_function_topk_alltoall": lambda: tape_training(
        "tape_function_topk_alltoall", grace.topk(0.05, communicator="alltoall"), True),
    "tape_function_onebit_alltoall": lambda: tape_training(
        "tape_function_onebit_alltoall", grace.onebit(memory="residual", communicator="alltoall"),
        True),
    "tape_function_topk_hierarchical": lambda: tape_training(
        "tape_function_topk_hierarchical", grace.topk(0.05, hierarchical=True), True),
    "keras_topk_alltoall": lambda: keras_fit("keras_topk_alltoall",
                                             grace.topk(0.05, communicator="alltoall"), False),
    "tape_function_randomk": lambda: tape_training("tape_function_randomk",
                                                   grace.randomk(0.05, seed=3, min_kept=1), True),
    "tape_function_fp16_sum": lambda: tape_training("tape_function_fp16_sum", grace.fp16(), True,
                                                    op=hvd.Sum),
    "tape_function_topk_groups": lambda: tape_training("tape_function_topk_groups", grace.topk(0.05),
                                                       True, groups=2),
    "keras_topk_accumulate2": lambda: keras_fit("keras_topk_accumulate2", grace.topk(0.05), False,
                                                accumulate=2),
    "legacy_topk": lambda: legacy_optimizer("legacy_topk", grace.topk(0.05)),
    "keras_topk": lambda: keras_fit("keras_topk", grace.topk(0.05)),
    # A layout-sensitive compressor sees Keras's kernel (W transposed) in PyTorch's order, W.
    "keras_onebit": lambda: keras_fit("keras_onebit", grace.onebit(), False),
    "keras_horovod_none": lambda: keras_fit("keras_horovod_none", hvd.Compression.none, False),
    # The optimizer's momentum taken over (grace.momentum): Keras, TF1, and warm-up under tf.function.
    "keras_dgc_momentum": lambda: keras_fit("keras_dgc_momentum", grace.dgc(0.05, sample_ratio=1.0),
                                            False, momentum=0.9),
    "keras_randomk_adam": lambda: keras_fit("keras_randomk_adam",
                                            grace.randomk(0.05, seed=3, min_kept=1), False,
                                            adam=True),
    "legacy_randomk_momentum": lambda: legacy_optimizer(
        "legacy_randomk_momentum", grace.randomk(0.05, seed=3, min_kept=1), momentum=0.9),
    "legacy_dgc_momentum": lambda: legacy_optimizer("legacy_dgc_momentum",
                                                    grace.dgc(0.05, sample_ratio=1.0), momentum=0.9),
    "tape_function_inceptionn_dense": lambda: tape_training(  # every element in the 32-bit class
        "tape_function_inceptionn_dense", grace.inceptionn(error_bound=2.0**-30), True),
    "tape_function_dgc_warmup": lambda: tape_training(
        "tape_function_dgc_warmup", grace.dgc(0.05, sample_ratio=1.0, warmup_steps=4), True),
}
for compressor in grace.available():  # every compressor, traced once in tf.function
    scenarios[f"catalogue_{compressor}"] = (
        lambda c=compressor: tape_training(f"catalogue_{c}", grace.build(c, min_numel=0), True,
                                           CATALOGUE_LR.get(c, LR)))
for name in (list(scenarios) if args.scenarios == "all" else args.scenarios.split(",")):
    scenarios[name]()
