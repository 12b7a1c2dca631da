"""Horovod's own optimizer tests (``test/parallel/test_torch.py`` of a Horovod source checkout, not
shipped in its sdist) with grace compression: every ``hvd.DistributedOptimizer(...)`` those tests
build without a compression gets ``grace.<name>()`` instead, on 2 Gloo workers.

    .venv/bin/python -m scripts.tools.horovod_own_tests /path/to/horovod/test/parallel/test_torch.py \\
        --compressors none,topk,randomk,powersgd,dgc,efsignsgd

Prints, per compression, the tests that passed and failed. ``horovod`` in the list runs them
unchanged (Horovod's own optimizer), the baseline. torch 2.13's ``Muon`` (2-d parameters only),
which Horovod 0.28's tests predate, is left out of the optimizers they loop over.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

from scripts import ROOT

# The tests of test_torch.py that build a DistributedOptimizer and run on the CPU.
TESTS = ("test_broadcast_state", "test_broadcast_state_options", "test_broadcast_state_no_grad",
         "test_force_allreduce", "test_model_parallelism", "test_delta_optimizer",
         "test_duplicate_names", "test_dynamic_requires_grad", "test_gradient_clipping",
         "test_synchronize_step_warning", "test_no_named_parameters",
         "test_missing_named_parameters", "test_optimizer_no_named_parameters",
         "test_sparse_embeddings", "test_optimizer_process_sets")

CONFTEST = '''
import os, sys
import torch
import horovod.torch as hvd
import grace

NAME = os.environ["GRACE_OWN_TESTS"]
if hasattr(torch.optim, "Muon"):
    torch.optim.Muon.__module__ = "left_out"  # their optimizer lists keep torch.optim's modules
if NAME != "horovod":
    _built = hvd.DistributedOptimizer

    def _with_grace(*args, **kwargs):
        if kwargs.get("compression") in (None, hvd.Compression.none):
            kwargs["compression"] = grace.build(NAME, min_numel=0)
        return _built(*args, **kwargs)

    hvd.DistributedOptimizer = _with_grace
'''


def run(test_file: str, name: str, workdir: str) -> tuple[list[str], list[str], str]:
    env = dict(os.environ, GRACE_OWN_TESTS=name, PYTHONPATH=os.path.join(workdir, "shim"))
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "pytest",
           "-q", "-rA", "-p", "no:cacheprovider", os.path.join(workdir, "parallel", "test_torch.py"),
           "-k", " or ".join(TESTS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    out = proc.stdout + proc.stderr
    rank0 = [line.split(":", 1)[1] for line in out.splitlines() if line.startswith("[0]<stdout>:")]
    passed = sorted({m.group(1) for line in rank0 if (m := re.match(r"PASSED \S+::(\w+)$", line))})
    failed = sorted({m.group(1) for line in rank0 if (m := re.match(r"FAILED \S+::(\w+)", line))})
    summary = next((line for line in reversed(rank0) if re.search(r"\d+ (passed|failed)", line)), "")
    return passed, failed, summary.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", help="Horovod's test/parallel/test_torch.py")
    parser.add_argument("--compressors", default="horovod,none,topk,randomk,powersgd,dgc,efsignsgd")
    args = parser.parse_args()
    source = os.path.dirname(os.path.dirname(os.path.abspath(args.test_file)))
    with tempfile.TemporaryDirectory() as workdir:
        # The test file imports ../utils/common.py, which imports the old `mock` package.
        shutil.copytree(os.path.join(source, "parallel"), os.path.join(workdir, "parallel"),
                        ignore=shutil.ignore_patterns("*.pyc"))
        shutil.copytree(os.path.join(source, "utils"), os.path.join(workdir, "utils"))
        os.makedirs(os.path.join(workdir, "shim"))
        with open(os.path.join(workdir, "shim", "mock.py"), "w") as f:
            f.write("from unittest.mock import *  # noqa: F401,F403\n")
        with open(os.path.join(workdir, "parallel", "conftest.py"), "w") as f:
            f.write(CONFTEST.format(root=ROOT))
        for name in args.compressors.split(","):
            passed, failed, summary = run(args.test_file, name, workdir)
            print(f"{name:10s} {summary}")
            for test in failed:
                print(f"    failed: {test}")


if __name__ == "__main__":
    main()
