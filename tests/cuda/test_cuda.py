"""The CUDA path, on a machine with a GPU (``make test-cuda``; ``make test`` leaves this folder out,
since CI has no GPU): every compressor's codec on CUDA tensors against the same on the CPU, and the
DDP hook over NCCL on one rank.

No Horovod is needed here (the GPU machines have none): the codecs run through the pipeline with a
group of one worker, and DDP through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import grace
from grace.collectives import Solo
from tests import reference
from tests.launch import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {"conv": (64, 32, 3, 3), "fc": (300, 256), "vector": (5000,)}
STEPS = 4


def _exchange(pipeline, device):
    """``STEPS`` steps of the pipeline on one worker (compression, error feedback, decompression)
    over fixed gradients made on the CPU and moved to ``device``; each step's results, on the CPU."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        tensors = [torch.randn(s, generator=generator).to(device) for s in SHAPES.values()]
        exchange = pipeline.start_bucket(tensors, list(SHAPES), Solo())
        out.append([t.cpu() for t in pipeline.finish_step([exchange], Solo())[0]])
    return out


@pytest.mark.parametrize("name", grace.available())
def test_every_codec_on_cuda_computes_what_it_does_on_the_cpu(name):
    """The same bytes on the wire, and the same results: to float32 rounding for every deterministic
    codec. A stochastic one draws the same numbers on both devices (grace.rng: counters, not the
    device's generator), so it too agrees, except where a value sits on a rounding boundary that
    a different order of summation moves by an ulp: at most 0.1 % of the elements may differ, each
    by at most one quantization level of its tensor."""
    cpu = grace.build(name, min_numel=0)
    gpu = grace.build(name, min_numel=0)
    on_cpu, on_gpu = _exchange(cpu, "cpu"), _exchange(gpu, "cuda")
    assert gpu.stats() == cpu.stats(), (gpu.stats(), cpu.stats())
    for step, (a_step, b_step) in enumerate(zip(on_cpu, on_gpu)):
        for shape_name, a, b in zip(SHAPES, a_step, b_step):
            assert b.dtype == a.dtype and b.shape == a.shape
            a64, b64 = a.double(), b.double()
            assert torch.isfinite(b64).all()
            scale = float(a64.abs().max()) or 1.0
            close = torch.isclose(b64, a64, rtol=1e-5, atol=1e-6 * scale)
            far = int((~close).sum())
            assert far <= 0.001 * a.numel(), (name, step, shape_name, far, a.numel())
            if far:
                levels = torch.unique(a64.abs())
                level = float(levels[levels > 0].min()) if (levels > 0).any() else scale
                gap = float((b64 - a64).abs().max())
                assert gap <= 1.0001 * 2 * level, (name, step, shape_name, gap, level)


def _torchrun(out, backend, scenarios, nproc=1):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "tests", "workers", "ddp_train.py"), str(out), "--backend", backend,
           "--scenarios", ",".join(scenarios)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


CATALOGUE = [f"catalogue_{c}" for c in grace.available()]


def test_ddp_hook_over_nccl_on_one_rank(tmp_path):
    """grace's DDP hook on a CUDA model over NCCL, one rank: top-k with error feedback matches
    the numpy model, and every compressor gives what it gives on the CPU over Gloo."""
    nccl, gloo = tmp_path / "nccl", tmp_path / "gloo"
    nccl.mkdir()
    gloo.mkdir()
    scenarios = ["topk", "none", "topk_nonfinite", "topk_skip3", *CATALOGUE]
    _torchrun(nccl, "nccl", scenarios)
    _torchrun(gloo, "gloo", CATALOGUE)
    w, b = reference.simulate(reference.topk_with_residual(0.05), workers=1)
    got = np.load(nccl / "topk.rank0.npz")
    np.testing.assert_allclose(got["w"], w, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got["b"], b, atol=1e-5, rtol=0)
    w, b = reference.simulate(None, workers=1)
    np.testing.assert_allclose(np.load(nccl / "none.rank0.npz")["w"], w, atol=1e-5, rtol=0)
    # A non-finite step skipped leaves the state as if the step had not been run.
    poisoned, skipped = np.load(nccl / "topk_nonfinite.rank0.npz"), np.load(nccl / "topk_skip3.rank0.npz")
    info = json.loads((nccl / "topk_nonfinite.rank0.json").read_text())
    assert info["skipped"] == [3]
    np.testing.assert_array_equal(poisoned["w"], skipped["w"])
    for name in CATALOGUE:
        a, b = np.load(gloo / f"{name}.rank0.npz"), np.load(nccl / f"{name}.rank0.npz")
        assert np.isfinite(b["w"]).all(), name
        np.testing.assert_allclose(b["w"], a["w"], atol=1e-4, rtol=0, err_msg=name)
        stats_a = json.loads((gloo / f"{name}.rank0.json").read_text())["stats"]
        stats_b = json.loads((nccl / f"{name}.rank0.json").read_text())["stats"]
        assert stats_a["bytes_sent"] == stats_b["bytes_sent"], name
