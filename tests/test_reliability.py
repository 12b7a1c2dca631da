"""Compression state survives checkpoints: a 2-worker run stopped after step 5 and resumed from its
checkpoints ends bit-identical to an uninterrupted 10-step run."""

from __future__ import annotations

import os

import numpy as np
import pytest
from launch import ROOT, horovodrun

TORCH_WORKER = os.path.join(ROOT, "tests", "workers", "torch_resume.py")
TF_WORKER = os.path.join(ROOT, "tests", "workers", "tf_resume.py")


def weights(out, name, phase, rank):
    data = np.load(out / f"{name}.{phase}.rank{rank}.npz")
    return data["w"], data["b"]


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_resume")
    for phase in ("full", "first", "second", "without_state", "elastic"):  # each in new processes
        horovodrun(TORCH_WORKER, str(out), phase)
    return out


@pytest.fixture(scope="module")
def tf_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf_resume")
    for phase in ("full", "first", "second"):
        horovodrun(TF_WORKER, str(out), phase)
    return out


def assert_same(out, name, phase):
    w0, _ = weights(out, name, "full", 0)
    for rank in range(2):
        full_w, full_b = weights(out, name, "full", rank)
        w, b = weights(out, name, phase, rank)
        np.testing.assert_array_equal(w, full_w)
        np.testing.assert_array_equal(b, full_b)
        np.testing.assert_array_equal(w, w0)  # and the workers agree


@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd", "randomk", "signum", "qsgd"])
def test_torch_resume_from_checkpoint_is_bit_identical(torch_runs, name):
    assert_same(torch_runs, name, "second")


@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd", "randomk", "signum", "qsgd"])
def test_resuming_without_the_compression_state_would_differ(torch_runs, name):
    """The control that gives the test above its meaning: the state matters for every one."""
    full_w, _ = weights(torch_runs, name, "full", 0)
    w, _ = weights(torch_runs, name, "without_state", 0)
    assert not np.array_equal(w, full_w)


@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd", "randomk", "signum", "qsgd"])
def test_torch_elastic_state_restores_compression_state(torch_runs, name):
    assert_same(torch_runs, name, "elastic")


@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd", "randomk"])
def test_tensorflow_checkpoint_resume_is_bit_identical(tf_runs, name):
    assert_same(tf_runs, name, "second")
