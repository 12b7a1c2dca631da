"""Starting real Horovod workers from a test: ``horovodrun`` with Gloo or MPI, bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", ""))
    return env


def horovodrun(script: str, *args: str, np: int = 2, controller: str = "gloo",
               timeout: float = 600) -> str:
    """Run ``python script args`` on ``np`` local workers; fail (with the output) on a non-zero exit
    or after ``timeout`` seconds, so that a hang is a failure, not a stuck suite."""
    cmd = [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", f"--{controller}"]
    if controller == "mpi":
        cmd += ["--mpi-args=--oversubscribe"]
    cmd += [sys.executable, script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}")
    return output
