"""Worker for tests/test_convergence.py: every compressor at its defaults trains an MLP on a real
slice of Fashion-MNIST, with the optimizer a user already has (SGD, lr 0.05, momentum 0.9, the
mnist workload's), for a few hundred steps; rank 0 writes each run's losses and test accuracy.

    horovodrun -np 2 python tests/workers/convergence.py OUT.json --framework torch

Each compressor starts from the same initial weights and sees the same batches, so the runs differ
by compression alone; ``fp32`` is Horovod's own uncompressed allreduce. signSGD and signum take the
learning rate their docs give (``grace.compressors.sign``)."""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np

import grace
from grace.compressors import sign
from scripts import fashion_mnist

HIDDEN, BATCH, LR, MOMENTUM = 128, 64, 0.05, 0.9
TEST_IMAGES = 2000


def learning_rate(name: str) -> float:
    name = name.partition("/")[0]
    if name == "signum":
        return sign.learning_rate()  # signum takes SGD's momentum over
    if name == "signsgd":
        return sign.learning_rate(momentum_in_optimizer=MOMENTUM)
    return LR


def data():
    train_x, train_y = fashion_mnist.load("train")
    test_x, test_y = fashion_mnist.load("test")
    return train_x, train_y, test_x[:TEST_IMAGES], test_y[:TEST_IMAGES]


def initial_weights(seed: int):
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((HIDDEN, 784)) * np.sqrt(2 / 784)).astype(np.float32)
    w2 = (rng.standard_normal((10, HIDDEN)) * np.sqrt(2 / HIDDEN)).astype(np.float32)
    return w1, np.zeros(HIDDEN, np.float32), w2, np.zeros(10, np.float32)


def compression(name: str, hvd=None):
    """``fp32``: Horovod's own uncompressed allreduce; ``X/memory=none``: compressor X at its
    defaults but without its memory (no residual, no momentum correction: the broken variant the
    test's bars must fail); else grace's compressor at its defaults."""
    if name == "fp32":
        return hvd.Compression.none
    name, _, memory = name.partition("/memory=")
    return grace.build(name, memory=memory or None)


def batches(rank: int, steps: int, n: int, seed: int):
    rng = np.random.default_rng(100 + rank + 1000 * seed)
    return [rng.integers(0, n, BATCH) for _ in range(steps)]


def run_torch(names, steps, seed):
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    train_x, train_y, test_x, test_y = (torch.from_numpy(a) for a in data())
    results = {}
    for name in names:
        model = torch.nn.Sequential(torch.nn.Linear(784, HIDDEN), torch.nn.ReLU(),
                                    torch.nn.Linear(HIDDEN, 10))
        with torch.no_grad():
            for p, w in zip(model.parameters(), initial_weights(seed)):
                p.copy_(torch.from_numpy(w))
        opt = torch.optim.SGD(model.parameters(), lr=learning_rate(name), momentum=MOMENTUM)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression(name, hvd))
        losses = []
        for idx in batches(hvd.rank(), steps, len(train_x), seed):
            idx = torch.from_numpy(idx)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx])
            loss.backward()
            opt.step()
            losses.append(float(loss))
        with torch.no_grad():
            accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
        weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
        results[name] = summary(losses, accuracy, weights, hvd)
    return hvd.rank(), results


def run_tf(names, steps, seed):
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    train_x, train_y, test_x, test_y = data()
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results = {}
    for name in names:
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(HIDDEN, activation="relu"),
                                  keras.layers.Dense(10)])
        w1, b1, w2, b2 = initial_weights(seed)
        model.set_weights([w1.T, b1, w2.T, b2])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate(name), momentum=MOMENTUM),
                                       compression=compression(name))

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = xent(y, model(x, training=True))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        losses = [float(step(train_x[idx], train_y[idx]))
                  for idx in batches(hvd.rank(), steps, len(train_x), seed)]
        accuracy = float(np.mean(np.argmax(model(test_x).numpy(), 1) == test_y))
        weights = np.concatenate([w.ravel() for w in model.get_weights()])
        results[name] = summary(losses, accuracy, weights, hvd)
    return hvd.rank(), results


def summary(losses, accuracy, weights, hvd) -> dict:
    """The run's start and end losses (means over 20 steps), accuracy, and whether every worker
    holds the same weights."""
    digests = hvd.allgather_object(hashlib.sha256(weights.tobytes()).hexdigest())
    return {"loss_start": float(np.mean(losses[:20])), "loss_end": float(np.mean(losses[-20:])),
            "digest": digests[0],
            "finite": bool(np.isfinite(losses).all() and np.isfinite(weights).all()),
            "accuracy": accuracy, "same_on_all_workers": len(set(digests)) == 1}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--framework", choices=("torch", "tf"), required=True)
    parser.add_argument("--compressors", default=",".join(grace.available()))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    args = parser.parse_args()
    names = args.compressors.split(",")
    rank, results = (run_torch if args.framework == "torch" else run_tf)(names, args.steps, args.seed)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
