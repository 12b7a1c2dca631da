"""TensorFlow's training loops give the same training: the quality benchmark's TensorFlow runs hand
each step's gradients to the Keras optimizer inside a ``tf.function`` step (``compare_worker.py
--loop step``); ``model.fit``, the way most Keras users train, and Horovod's
``DistributedGradientTape``, the way TF2 loops are written, must end with the same weights, bit for
bit, from the same batches, so that the benchmark's figures hold for them. Every worker must end
with the same weights in each loop. Real Horovod workers (2, Gloo), the mnist MLP on Fashion-MNIST,
a pass of 24 steps a worker after one warm-up step."""

from __future__ import annotations

import argparse
import functools
import json

import pytest

from scripts import compare

pytestmark = pytest.mark.slow

TOPK = json.dumps({"compressor": "topk", "ratio": 0.01})
TOPK_PLAIN = json.dumps({"compressor": "topk", "ratio": 0.01, "memory": "residual"})
QSGD = json.dumps({"compressor": "qsgd"})
DGC = json.dumps({"compressor": "dgc"})
ONEBIT = json.dumps({"compressor": "onebit"})
STEPS = 24


def train(compression: str, loop: str, optimizer: str = "sgd") -> dict:
    return _train(compression, loop, optimizer)


@functools.cache  # one run serves every test that compares it
def _train(compression: str, loop: str, optimizer: str) -> dict:
    args = argparse.Namespace(epochs=1, steps=STEPS, exchange_steps=STEPS, timeout=900)
    extra = ("--loop", loop, "--optimizer", optimizer)
    row = compare.run_one("tf", "mnist", compression, None, 2, args, emulate=False, extra=extra)
    assert row["status"] == "ok", row["status"]
    assert row["loop"] == loop  # the worker ran the loop asked for
    assert row["workers_agree"], f"{compression} --loop {loop}: the workers' weights differ"
    return row


@pytest.mark.parametrize("compression,optimizer", [
    ("fp32", "sgd"),     # Horovod's tape in the step loop; compression=grace.none() under model.fit
    (TOPK, "sgd"),       # error feedback on the velocity, SGD's momentum taken over
    (DGC, "sgd"),        # SGD's momentum taken over by the compressor
    (ONEBIT, "adam"),    # Adam's first moment taken over
])
def test_model_fit_trains_as_the_benchmarks_step(compression, optimizer):
    step, fit = train(compression, "step", optimizer), train(compression, "fit", optimizer)
    assert fit["weights_sha256"] == step["weights_sha256"]
    if compression != "fp32":  # fp32's bytes are the dense estimate in both: nothing to compare
        assert fit["bytes_per_step"] == step["bytes_per_step"]


def test_the_digest_tells_trainings_apart():
    """The loops' agreement means something only if different trainings give different digests:
    fp32, top-k and DGC from the same start and batches end with three different weights."""
    digests = {train(c, "step")["weights_sha256"] for c in ("fp32", TOPK, DGC)}
    assert len(digests) == 3


@pytest.mark.parametrize("compression", [TOPK_PLAIN, QSGD])  # plain error feedback; no memory
def test_the_tape_trains_as_the_optimizer_wrapper_where_nothing_is_taken_over(compression):
    step, tape = train(compression, "step"), train(compression, "tape")
    assert tape["weights_sha256"] == step["weights_sha256"]
    assert tape["bytes_per_step"] == step["bytes_per_step"]


def test_the_tape_differs_from_the_wrapper_where_the_wrapper_takes_momentum_over():
    """The control: DGC under the tape applies its own momentum and the optimizer's 0.9 applies
    again (said on rank 0 as the tape is built); the wrapper takes the optimizer's over. The digest
    tells the two apart. So for top-k at its defaults, whose error feedback is on the velocity under
    the wrapper and plain under the tape, where the optimizer keeps its momentum."""
    assert train(DGC, "tape")["weights_sha256"] != train(DGC, "step")["weights_sha256"]
    assert train(TOPK, "tape")["weights_sha256"] == train(TOPK_PLAIN, "step")["weights_sha256"]
    assert train(TOPK, "tape")["weights_sha256"] != train(TOPK, "step")["weights_sha256"]
