"""Compression state survives checkpoints: a 2-worker run stopped after step 5 and resumed from its
checkpoints ends bit-identical to an uninterrupted 10-step run."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.launch import ROOT, horovodrun
from tests.workers.scenarios import params

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
    # Two launches of TensorFlow instead of four (each costs tens of seconds here): the resumed
    # phases run in new processes, after the one that wrote the checkpoint has ended.
    for phases in ("full,first", "second,without_state"):
        horovodrun(TF_WORKER, str(out), phases)
    return out


def assert_same(out, name, phase):
    w0, _ = weights(out, name, "full", 0)
    for rank in range(2):
        full_w, full_b = weights(out, name, "full", rank)
        w, b = weights(out, name, phase, rank)
        np.testing.assert_array_equal(w, full_w)
        np.testing.assert_array_equal(b, full_b)
        np.testing.assert_array_equal(w, w0)  # and the workers agree


@pytest.mark.slow  # its module's runs take a minute or more (Makefile: test-slow)
@pytest.mark.parametrize("name", params("torch", "resume"))
def test_torch_resume_from_checkpoint_is_bit_identical(torch_runs, name):
    assert_same(torch_runs, name, "second")


@pytest.mark.slow  # its module's runs take a minute or more (Makefile: test-slow)
@pytest.mark.parametrize("name", params("torch", "resume"))
def test_resuming_without_the_compression_state_would_differ(torch_runs, name):
    """The control that gives the test above its meaning: the state matters for every one."""
    full_w, _ = weights(torch_runs, name, "full", 0)
    w, _ = weights(torch_runs, name, "without_state", 0)
    assert not np.array_equal(w, full_w)


@pytest.mark.slow  # its module's runs take a minute or more (Makefile: test-slow)
@pytest.mark.parametrize("name", params("tf", "resume"))
def test_tensorflow_resuming_without_the_compression_state_would_differ(tf_runs, name):
    full_w, _ = weights(tf_runs, name, "full", 0)
    w, _ = weights(tf_runs, name, "without_state", 0)
    assert not np.array_equal(w, full_w)


@pytest.mark.slow  # its module's runs take a minute or more (Makefile: test-slow)
@pytest.mark.parametrize("name", params("torch", "resume"))
def test_torch_elastic_state_restores_compression_state(torch_runs, name):
    assert_same(torch_runs, name, "elastic")


@pytest.mark.slow  # its module's runs take a minute or more (Makefile: test-slow)
@pytest.mark.parametrize("name", params("tf", "resume"))
def test_tensorflow_checkpoint_resume_is_bit_identical(tf_runs, name):
    assert_same(tf_runs, name, "second")


NONFINITE_WORKER = os.path.join(ROOT, "tests", "workers", "torch_nonfinite.py")


@pytest.fixture(scope="module")
def nonfinite_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite")
    horovodrun(NONFINITE_WORKER, str(out))
    return out


def flatten_state(state):
    """(path, value) pairs of every part of a pipeline state_dict, tensors as numpy."""
    items = []
    for part in ("compressor", "memory", "dense_memory", "pipeline"):
        for attr, entries in state[part].items():
            for name, value in entries.items():
                items.append((f"{part}.{attr}.{name}", value.numpy() if hasattr(value, "numpy") else value))
    return sorted(items, key=lambda item: item[0])


@pytest.mark.parametrize("name", params("torch", "nonfinite"))
def test_overflow_on_one_worker_is_skipped_everywhere_and_leaves_no_trace(nonfinite_run, name):
    import torch

    for rank in range(2):
        record = (nonfinite_run / f"{name}.skip.rank{rank}.txt").read_text()
        unchanged, scale_before, scale_after = record.split()
        assert unchanged == "1"  # GradScaler saw the Inf on both workers and skipped the step
        assert float(scale_after) == float(scale_before) / 2
        before = flatten_state(torch.load(nonfinite_run / f"{name}.before.rank{rank}.pt"))
        after = flatten_state(torch.load(nonfinite_run / f"{name}.after.rank{rank}.pt"))
        assert [k for k, _ in before] == [k for k, _ in after] and before
        for (key, a), (_, b) in zip(before, after):
            assert np.array_equal(a, b), f"{key} changed during the skipped step on rank {rank}"
        overflow = np.load(nonfinite_run / f"{name}.overflow.rank{rank}.npz")
        skipped = np.load(nonfinite_run / f"{name}.skipped.rank{rank}.npz")
        np.testing.assert_array_equal(overflow["w"], skipped["w"])
        np.testing.assert_array_equal(overflow["b"], skipped["b"])


@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd", "randomk", "onebit"])
def test_an_overflow_in_one_layer_leaves_no_trace_in_any_layer(nonfinite_run, name):
    """Two compressed layers; the second one's gradient is Inf on one worker (a tensor hook). The
    loss scaler skips the step, so neither layer's residuals, velocities or counters may change,
    and the weights end equal to a run without that step."""
    import torch

    for rank in range(2):
        before = flatten_state(torch.load(nonfinite_run / f"layer_{name}.before.rank{rank}.pt"))
        after = flatten_state(torch.load(nonfinite_run / f"layer_{name}.after.rank{rank}.pt"))
        layers = {key.split(".")[-2] for key, _ in before}
        assert [k for k, _ in before] == [k for k, _ in after] and {"0", "2"} <= layers
        for (key, a), (_, b) in zip(before, after):
            assert np.array_equal(a, b), f"{key} changed during the skipped step on rank {rank}"
        overflow = np.load(nonfinite_run / f"layer_{name}.overflow.rank{rank}.npz")
        skipped = np.load(nonfinite_run / f"layer_{name}.skipped.rank{rank}.npz")
        for key in overflow.files:
            np.testing.assert_array_equal(overflow[key], skipped[key])


def test_without_the_check_the_overflow_enters_the_residuals(nonfinite_run):
    """The control: with check_finite=False the Inf reaches the scaler through top-k's payload, but
    the worker that overflowed keeps it in its residual."""
    import torch

    before = dict(flatten_state(torch.load(nonfinite_run / "topk_unchecked.before.rank1.pt")))
    after = dict(flatten_state(torch.load(nonfinite_run / "topk_unchecked.after.rank1.pt")))
    residual = after["memory.residuals.weight"]
    assert not np.isfinite(residual).all()
    assert not np.array_equal(before["memory.residuals.weight"], residual)


MISMATCH_WORKER = os.path.join(ROOT, "tests", "workers", "torch_mismatch.py")


@pytest.mark.parametrize("scenario, message", [
    ("compressor", r"worker 0 compresses with Pipeline\(compressor=TopK\(ratio=0.01\).* but worker 1 "
                   r"with Pipeline\(compressor=TopK\(ratio=0.02\)"),
    ("shape", r"tensor 'body.weight' is torch.float32 \[1200, 16\] on worker 0 but torch.float32 "
              r"\[1300, 16\] on worker 1"),
    ("names", r"tensor 'extra.weight' exists on worker 1 but not on worker 0"),
])
def test_workers_that_differ_fail_at_construction_on_every_worker(tmp_path, scenario, message):
    import re

    horovodrun(MISMATCH_WORKER, str(tmp_path), scenario, timeout=120)
    for rank in range(2):
        error = (tmp_path / f"{scenario}.error.rank{rank}.txt").read_text()
        assert error.startswith("grace: the workers are not set up alike")
        assert re.search(message, error), error


def test_a_parameter_only_some_workers_use_in_a_step_does_not_hang(tmp_path):
    horovodrun(MISMATCH_WORKER, str(tmp_path), "unused", timeout=120)
    a, b = (np.load(tmp_path / f"unused.rank{rank}.npz") for rank in range(2))
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key])


def test_a_worker_that_dies_fails_the_others_within_a_bounded_time(tmp_path):
    import time

    start = time.monotonic()
    with pytest.raises(AssertionError, match="exited"):
        horovodrun(MISMATCH_WORKER, str(tmp_path), "dies", timeout=120)
    assert time.monotonic() - start < 60
    assert not (tmp_path / "dies.rank0.npz").exists()


EDGES_WORKER = os.path.join(ROOT, "tests", "workers", "torch_edges.py")


@pytest.fixture(scope="module")
def edges_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("edges")
    horovodrun(EDGES_WORKER, str(out), timeout=300)
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["sparse_as_dense", "sparse"])
@pytest.mark.parametrize("name", ["topk", "qsgd", "powersgd", "signum", "none"])
def test_awkward_parameters_train_alike_on_every_worker(edges_run, name, sparse):
    """Each kind of parameter, the embedding's sparse gradient sent dense (``sparse_as_dense``)
    or as rows (grace.sparse)."""
    name = f"{name}.sparse" if sparse else name
    a, b = (np.load(edges_run / f"{name}.rank{rank}.npz") for rank in range(2))
    assert list(a["dtypes"]) == ["torch.float32"] * 4 + ["torch.float16", "torch.bfloat16",
                                                           "torch.float64", "torch.float32"] + \
        ["torch.float32"] * 2
    for key in a.files:
        if key == "dtypes":
            continue
        np.testing.assert_array_equal(a[key], b[key])
        assert np.isfinite(a[key]).all(), key
    assert a["empty"].shape == (0, 4) and a["scalar"].shape == ()
    start = np.load(edges_run / f"{name}.start.rank0.npz")
    for key in ("single", "transposed", "fp16_weight", "bf16_weight", "fp64_weight", "embedding.weight"):
        assert not np.array_equal(a[key], start[key]), f"{key} was not trained"
    if name.startswith("signum"):
        # The two workers' gradients for the scalar have opposite signs at every step here, so the
        # majority vote is a tie (0) and it stays put.
        assert a["scalar"] == start["scalar"]
    else:
        assert a["scalar"] != start["scalar"]  # the 0-d parameter was trained


TF_NONFINITE_WORKER = os.path.join(ROOT, "tests", "workers", "tf_nonfinite.py")


@pytest.fixture(scope="module")
def tf_nonfinite_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf_nonfinite")
    horovodrun(TF_NONFINITE_WORKER, str(out), timeout=400)
    return out


@pytest.mark.slow  # its module's runs take a minute or more (Makefile: test-slow)
@pytest.mark.parametrize("name", params("tf", "nonfinite"))
def test_tensorflow_overflow_leaves_no_trace_under_tf_function(tf_nonfinite_run, name):
    import pickle

    for rank in range(2):
        record = pickle.loads((tf_nonfinite_run / f"tf_{name}.states.rank{rank}.pkl").read_bytes())
        assert record["unchanged"]
        before, after = record["before"], record["after"]
        assert before["memory"] or before["compressor"]  # there is state to compare
        for part in ("compressor", "memory"):
            assert before[part].keys() == after[part].keys()
            for attr in before[part]:
                assert before[part][attr].keys() == after[part][attr].keys()
                for key in before[part][attr]:
                    assert np.array_equal(before[part][attr][key], after[part][attr][key]), \
                        f"{part}.{attr}.{key} changed on rank {rank}"
        overflow = np.load(tf_nonfinite_run / f"tf_{name}.overflow.rank{rank}.npz")
        skipped = np.load(tf_nonfinite_run / f"tf_{name}.skipped.rank{rank}.npz")
        np.testing.assert_array_equal(overflow["w"], skipped["w"])
        np.testing.assert_array_equal(overflow["b"], skipped["b"])
