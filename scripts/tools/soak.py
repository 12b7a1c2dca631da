"""Soak benchmark (not a test): many steps of a small model on 2 Horovod workers with each stateful
compressor, sampling resident memory and the size of the compression state as it goes; both must stay
flat after warm-up. Prints a markdown table and writes ``--out`` (JSON and a PNG plot).

    python -m scripts.tools.soak --steps 20000             # launches horovodrun -np 2 itself
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from scripts import ROOT

STATEFUL = ["topk", "randomk", "threshold", "dgc", "powersgd", "signum", "efsignsgd", "onebit", "adaq",
            "qsgd"]


def worker(args):
    import horovod.torch as hvd
    import numpy as np
    import psutil
    import torch

    import grace

    torch.set_num_threads(1)
    hvd.init()
    process = psutil.Process()
    results = {}
    for name in args.compressors.split(","):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        compression = grace.build(name, min_numel=0)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters(),
                                             compression=compression)
        rng = np.random.default_rng(hvd.rank())
        x = torch.from_numpy(rng.standard_normal((256, 64)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, 10, 256))
        samples, start = [], time.perf_counter()
        for step in range(1, args.steps + 1):
            idx = torch.from_numpy(rng.integers(0, 256, 32))
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
            if step % args.every == 0 or step == 1:
                state = compression.state_dict()
                state_bytes = sum(v.numel() * v.element_size() for part in ("compressor", "memory")
                                  for entries in state[part].values() for v in entries.values()
                                  if hasattr(v, "numel"))
                samples.append({"step": step, "rss_mib": process.memory_info().rss / 2**20,
                                "state_bytes": state_bytes})
        results[name] = {"samples": samples, "seconds": time.perf_counter() - start}
        if hvd.rank() == 0:
            print("SOAK " + json.dumps({name: results[name]}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--compressors", default=",".join(STATEFUL))
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "soak"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from tqdm import tqdm

    os.makedirs(args.out, exist_ok=True)
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H", "localhost:2",
           "--gloo", sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
           "--every", str(args.every), "--compressors", args.compressors]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    results = {}
    names = args.compressors.split(",")
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    with popen as proc, tqdm(total=len(names), desc="soak", unit="compressor") as bar:
        for line in proc.stdout:
            if "SOAK " in line:
                results.update(json.loads(line.split("SOAK ", 1)[1]))
                bar.update(1)
    if proc.returncode:
        raise SystemExit(f"horovodrun exited {proc.returncode}")
    lines = ["| compressor | steps | s | RSS MiB at 1k | RSS MiB at end | growth MiB | state bytes at 1k "
             "| state bytes at end |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        first = next(s for s in r["samples"] if s["step"] >= min(1000, args.steps))
        last = r["samples"][-1]
        lines.append(f"| {name} | {last['step']} | {r['seconds']:.0f} | {first['rss_mib']:.1f} | "
                     f"{last['rss_mib']:.1f} | {last['rss_mib'] - first['rss_mib']:+.1f} | "
                     f"{first['state_bytes']} | {last['state_bytes']} |")
    print("\n".join(lines))
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(results, f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot([s["step"] for s in r["samples"]], [s["rss_mib"] for s in r["samples"]], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("resident memory of worker 0 (MiB)")
    ax.set_title("Soak: 2 workers, small MLP")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "soak_rss.png"), dpi=110)


if __name__ == "__main__":
    main()
