"""Worker for tests/test_horovod_tensorflow.py: trains common.py's linear model with TensorFlow and
Horovod under several configurations; saves each rank's final weights and compression stats.

Run by ``horovodrun -np 2 python tests/workers/tf_train.py OUTDIR [--scenarios a,b]``."""

from __future__ import annotations

import argparse
import json
import logging
import os

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import keras
import numpy as np
import tensorflow as tf

import grace
from frameworks.tensorflow.keras import BroadcastGlobalVariablesCallback
from tests.workers.common import BATCH, CATALOGUE_LR, LR, batch, init_weights

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


class Linear(keras.Model):
    """common.py's model as a Keras 3 model: its variables are Keras 3 variables (no ``ref()``),
    named ``weight`` and ``bias`` as the tf.Variables of ``variables()`` are, so that grace names,
    seeds and lays out their gradients alike."""

    def __init__(self, start=0.0):
        super().__init__()
        w, b = init_weights(0)
        self.weight = keras.Variable(w + start, name="weight")
        self.bias = keras.Variable(b + start, name="bias")

    def call(self, x):
        return tf.matmul(x, self.weight, transpose_b=True) + self.bias


def keras_tape(name, make_compression, lr=LR, start=0.0):
    """The TF2 loop of Horovod's own examples, over a Keras 3 model: ``tf.function`` step taking a
    Python ``first_batch`` (two concrete functions), the compression built inside the step, a tape
    over ``model.trainable_variables``, Keras's SGD, and ``hvd.broadcast_variables`` of the model's
    and the optimizer's variables after the first step."""
    model = Linear(start if rank else 0.0)
    opt = keras.optimizers.SGD(lr)
    built = []

    @tf.function
    def step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        compression = make_compression()
        built.append(compression)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    for s in range(args.steps):
        step(*(tf.constant(a) for a in batch(rank, s)), s == 0)
    # Every trace builds its own; the exchanges of all went through the first (shared_while_tracing).
    stats = built[0].stats() if isinstance(built[0], grace.Pipeline) else None
    save(name, model.weight.numpy(), model.bias.numpy(), stats, traces=len(built))


def keras_two_functions(name):
    """Two tf.function steps made by one factory, over two Keras models whose variables have the
    same names, each building grace.topk(0.05) inside, at the same line: one pipeline per function
    (residuals, counters), each counting its own model's exchanges only."""
    models = [Linear(), Linear()]
    models[1].weight.assign(models[1].weight * 2.0)
    built = [[], []]

    def make(i):
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(models[i](x) - y))
            built[i].append(grace.topk(0.05))
            tape = hvd.DistributedGradientTape(tape, compression=built[i][-1])
            for v, g in zip(models[i].trainable_variables,
                            tape.gradient(loss, models[i].trainable_variables)):
                v.assign_sub(LR * g)
        return step

    steps = [make(0), make(1)]
    for s in range(args.steps):
        for step in steps:
            step(*(tf.constant(a) for a in batch(rank, s)))
    save(name, models[0].weight.numpy(), models[0].bias.numpy(), None,
         tensors=[b[0].stats()["tensors"] for b in built])


def keras_broadcast(name):
    """``hvd.broadcast_variables`` of a Keras 3 model's and optimizer's variables, eagerly and in a
    ``tf.function``: rank 1 starts 1.0 off, with its own optimizer step count."""
    saved = {}
    for way in ("eager", "function"):
        model = Linear(1.0 if rank else 0.0)
        opt = keras.optimizers.SGD(LR, momentum=0.9)
        opt.build(model.trainable_variables)
        opt.iterations.assign(rank + 5)
        for v in opt.variables:  # the momentum slots too: rank + 1 everywhere, but the count
            if v is not opt.iterations:
                v.assign(tf.fill(v.shape, float(rank + 1)))

        def broadcast():
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

        (tf.function(broadcast) if way == "function" else broadcast)()
        saved[way] = [model.weight.numpy().tolist(), model.bias.numpy().tolist(),
                      int(opt.iterations.numpy()),
                      sorted({float(x) for v in opt.variables if v is not opt.iterations
                              for x in np.ravel(v.numpy())})]
    w0, b0 = init_weights(0)
    save(name, w0, b0, None, **saved)


def keras_local_source(name):
    """A Keras 3 variable registered as a local source: its gradient is this worker's own, divided
    by the workers' count (Horovod's ``scale_local_gradients``); the others are averaged."""
    model = Linear()
    x, y = (tf.constant(a) for a in batch(rank, 0))
    with tf.GradientTape() as plain:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    own = plain.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape, compression=grace.none())
    tape.register_local_source(model.bias)
    gw, gb = tape.gradient(loss, model.trainable_variables)
    save(name, gw.numpy(), gb.numpy(), None, own_w=own[0].numpy().tolist(),
         own_b=own[1].numpy().tolist())


def keras_horovod_callbacks(name):
    """Horovod's own Keras callbacks on Keras 3 (mended by import grace), as Horovod's
    tensorflow2_keras_mnist.py uses them: broadcast, metric averaging and the learning-rate warm-up
    over 2 of 3 epochs of 5 steps, SGD with momentum, grace.topk with plain error feedback (the
    optimizer keeps its momentum, which the schedule would correct); rank 1 starts 1.0 off."""
    w, b = init_weights(0)
    log = GraceLog()
    logging.getLogger("grace").addHandler(log)
    model = keras.Sequential([keras.Input((w.shape[1],)), keras.layers.Dense(w.shape[0])])
    model.layers[0].set_weights([w.T + (1.0 if rank else 0.0), b + (1.0 if rank else 0.0)])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9),
                                         compression=grace.topk(0.05, memory="residual"))
    model.compile(optimizer=opt, loss="mse")
    x = np.concatenate([batch(rank, s)[0] for s in range(5)])
    y = np.concatenate([batch(rank, s)[1] for s in range(5)])
    raw = []  # each epoch's loss on this worker, before the average

    class Warmup(hvd_keras.callbacks.LearningRateWarmupCallback):
        """A user's subclass: its own on_epoch_end runs, and Horovod's (mended) through super()."""
        seen: list = []

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append(epoch)
            super().on_epoch_end(epoch, logs)

    callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                 keras.callbacks.LambdaCallback(
                     on_epoch_end=lambda epoch, logs: raw.append(float(logs["loss"]))),
                 hvd_keras.callbacks.MetricAverageCallback(),
                 Warmup(initial_lr=LR, warmup_epochs=2, steps_per_epoch=5)]
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=callbacks)
    logging.getLogger("grace").removeHandler(log)
    kernel, bias = model.layers[0].get_weights()
    save(name, kernel.T, bias, None, lr=[float(v) for v in history.history["lr"]],
         loss=[float(v) for v in history.history["loss"]], raw_loss=raw, grace_log=log.lines,
         subclass_saw=Warmup.seen)


def said_while(name, run):
    """``run()``, saving the lines grace logged meanwhile on this worker."""
    from frameworks import process_set

    process_set._TOLD.clear()  # each scenario hears what it causes, whatever ran before it
    log = GraceLog()
    logging.getLogger("grace").addHandler(log)
    try:
        run()
    finally:
        logging.getLogger("grace").removeHandler(log)
    w, b = init_weights(0)
    save(name, w, b, None, grace_log=log.lines)


def keras_signsgd_fit():
    """Keras model.fit with signSGD at SGD's usual rate: said at the first step."""
    w, _ = init_weights(0)
    model = keras.Sequential([keras.Input((w.shape[1],)), keras.layers.Dense(w.shape[0])])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                           compression=grace.signsgd()), loss="mse")
    x, y = batch(rank, 0)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)


def plain_tape(name):
    """Horovod's tape as a Horovod script builds it, no compression given, with import grace: it
    stays Horovod's (no grace pipeline, Horovod's defaults: op=None is accepted, and so is Adasum
    at construction), mended for Keras 3 variables; one eager step over the Keras model."""
    model = Linear()
    x, y = (tf.constant(a) for a in batch(rank, 0))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape)
    grace_pipeline = hasattr(tape, "_grace_pipeline")
    gw, gb = tape.gradient(loss, model.trainable_variables)
    try:
        hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum)
        adasum_error = None
    except ValueError as e:
        adasum_error = str(e)
    save(name, gw.numpy(), gb.numpy(), None, grace_pipeline=grace_pipeline,
         adasum_error=adasum_error)


def keras_tape_unmended(name):
    """GRACE_MEND_HOROVOD=0: Horovod's own tape over a Keras 3 model, as Horovod 0.28.1 has it."""
    model = Linear()
    x, y = (tf.constant(a) for a in batch(rank, 0))
    os.environ["GRACE_MEND_HOROVOD"] = "0"
    try:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.none)
        tape.gradient(loss, model.trainable_variables)
        error = None
    except AttributeError as e:
        error = str(e)
    os.environ["GRACE_MEND_HOROVOD"] = "0"
    try:
        hvd.broadcast_variables(model.variables, root_rank=0)
        broadcast_error = None
    except AttributeError as e:
        broadcast_error = str(e)
    finally:
        del os.environ["GRACE_MEND_HOROVOD"]
    w, b = init_weights(0)
    save(name, w, b, None, error=error, broadcast_error=broadcast_error)


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


def keras_fit(name, compression, different_start=True, momentum=0.0, accumulate=None, adam=False,
              adam_options=None):
    w, b = init_weights(0)
    log = GraceLog()
    logging.getLogger("grace").addHandler(log)
    model = keras.Sequential([keras.Input((w.shape[1],)), keras.layers.Dense(w.shape[0])])
    start = 0.0 if rank == 0 or not different_start else 1.0  # rank 0's weights are broadcast
    model.layers[0].set_weights([w.T + start, b + start])
    # Keras divides an accumulated sum by its steps: twice the rate gives the sum's update.
    base = keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulate,
                                 **(adam_options or {})) if adam else keras.optimizers.SGD(
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
    # Adam's second moment of the kernel: zero where the wrapper steps the kernel itself.
    setting = {"optimizer_beta_1": float(model.optimizer.beta_1), "adam_kernel_velocity": float(
        np.abs(model.optimizer._velocities[model.optimizer._get_variable_index(
            model.layers[0].kernel)].numpy()).max())} if adam else {
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
    "tape_function_twobit": lambda: tape_training("tape_function_twobit", grace.twobit(), True),
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
    "keras_twobit": lambda: keras_fit("keras_twobit", grace.twobit(), False),
    "keras_horovod_none": lambda: keras_fit("keras_horovod_none", hvd.Compression.none, False),
    # The optimizer's momentum taken over (grace.momentum): Keras, TF1, and warm-up under tf.function.
    "keras_dgc_momentum": lambda: keras_fit("keras_dgc_momentum", grace.dgc(0.05, sample_ratio=1.0),
                                            False, momentum=0.9),
    "keras_topk_momentum": lambda: keras_fit("keras_topk_momentum", grace.topk(0.05), False,
                                             momentum=0.9),
    "keras_dgc_keep_optimizer": lambda: keras_fit(
        "keras_dgc_keep_optimizer", grace.dgc(0.05, sample_ratio=1.0, keep_optimizer=True), False,
        momentum=0.9),
    "keras_randomk_adam": lambda: keras_fit("keras_randomk_adam",
                                            grace.randomk(0.05, seed=3, min_kept=1), False,
                                            adam=True),
    # Where Keras would change the updates on their way, Adam keeps its moments (no takeover).
    # Epsilon 1e-3: Adam's float32 steps of entries whose gradient is near zero (random-k's
    # undrawn ones) are then not a few parts in a thousand from the float64 model's.
    **{f"keras_randomk_adam_{option}": (lambda option=option, value=value: keras_fit(
        f"keras_randomk_adam_{option}", grace.randomk(0.05, seed=3, min_kept=1), False, adam=True,
        accumulate=2 if option == "accumulate" else None,
        adam_options={"epsilon": 1e-3, **({} if option == "accumulate" else {option: value})}))
       for option, value in (("clipnorm", 1e6), ("loss_scale_factor", 4.0), ("use_ema", True),
                             ("accumulate", None))},
    "legacy_randomk_momentum": lambda: legacy_optimizer(
        "legacy_randomk_momentum", grace.randomk(0.05, seed=3, min_kept=1), momentum=0.9),
    "legacy_dgc_momentum": lambda: legacy_optimizer("legacy_dgc_momentum",
                                                    grace.dgc(0.05, sample_ratio=1.0), momentum=0.9),
    "tape_function_inceptionn_dense": lambda: tape_training(  # every element in the 32-bit class
        "tape_function_inceptionn_dense", grace.inceptionn(error_bound=2.0**-30), True),
    "tape_function_dgc_warmup": lambda: tape_training(
        "tape_function_dgc_warmup", grace.dgc(0.05, sample_ratio=1.0, warmup_steps=4), True),
}
def fuses_sums(name):
    """Whether grace's Horovod collectives say they fuse sums themselves, eagerly and in a graph."""
    from frameworks.tensorflow.collectives import HorovodCollectives

    collectives, traced = HorovodCollectives(), []

    @tf.function
    def probe():
        traced.append(collectives.fuses_sums)
        return tf.constant(0)

    probe()
    w, b = init_weights(0)
    save(name, w, b, eager=collectives.fuses_sums, traced=traced[0])


scenarios.update({
    "fuses_sums": lambda: fuses_sums("fuses_sums"),
    "keras_tape_horovod_none": lambda: keras_tape("keras_tape_horovod_none",
                                                  lambda: hvd.Compression.none),
    "keras_tape_horovod_fp16": lambda: keras_tape("keras_tape_horovod_fp16",
                                                  lambda: hvd.Compression.fp16),
    "keras_tape_topk_broadcast": lambda: keras_tape("keras_tape_topk_broadcast",
                                                    lambda: grace.topk(0.05), start=1.0),
    "keras_broadcast": lambda: keras_broadcast("keras_broadcast"),
    "keras_two_functions": lambda: keras_two_functions("keras_two_functions"),
    "tape_function_twobit_absolute": lambda: tape_training(
        "tape_function_twobit_absolute", grace.twobit(0.05, relative=False), True),
    "keras_local_source": lambda: keras_local_source("keras_local_source"),
    "keras_horovod_callbacks": lambda: keras_horovod_callbacks("keras_horovod_callbacks"),
    "keras_tape_unmended": lambda: keras_tape_unmended("keras_tape_unmended"),
    "plain_tape": lambda: plain_tape("plain_tape"),
    # Under the tape, DGC's own momentum (it sees no optimizer), said once over three traces.
    # The momentum given to DGC and none to the optimizer: b, which travels dense, gets it too.
    "tape_dgc_given": lambda: tape_training("tape_dgc_given",
                                            grace.dgc(0.05, sample_ratio=1.0, momentum=0.9), True),
    "tape_dgc_said": lambda: said_while("tape_dgc_said", lambda: keras_tape(
        "tape_dgc_said.run", lambda: grace.dgc(0.05, sample_ratio=1.0))),
    "keras_signsgd_said": lambda: said_while("keras_signsgd_said", keras_signsgd_fit),
})
for compressor in grace.available():  # every compressor, traced once in tf.function
    scenarios[f"catalogue_{compressor}"] = (
        lambda c=compressor: tape_training(f"catalogue_{c}", grace.build(c, min_numel=0), True,
                                           CATALOGUE_LR.get(c, LR)))
    # The same over a Keras 3 model, the compression built inside the step (Horovod's examples).
    scenarios[f"keras_tape_{compressor}"] = (
        lambda c=compressor: keras_tape(f"keras_tape_{c}", lambda: grace.build(c, min_numel=0),
                                        CATALOGUE_LR.get(c, LR)))
for name in (list(scenarios) if args.scenarios == "all" else args.scenarios.split(",")):
    scenarios[name]()
