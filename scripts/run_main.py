"""The main job (``make run``): 2-worker ``horovodrun`` training on Fashion-MNIST, once uncompressed
(Horovod's own allreduce) and once with ``grace.topk(0.01)``; per epoch the loss, accuracy, wall time
and bytes each worker sent against the dense bytes, then a comparison table (markdown), a JSON file and
a plot (accuracy against wall time) under ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "uncompressed (Horovod allreduce)": "",
    "grace.topk(0.01)": json.dumps({"compressor": "topk", "ratio": 0.01}),
}


def launch(label: str, compression: str, args, bar) -> list[dict]:
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(args.np),
           "-H", f"localhost:{args.np}", "--gloo", sys.executable,
           os.path.join(ROOT, "scripts", "train_fashion_mnist.py"), "--epochs", str(args.epochs),
           "--compression", compression, "--limit", str(args.limit)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    epochs, tail = [], []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=ROOT) as proc:
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            if "EPOCH " in line:
                row = json.loads(line.split("EPOCH ", 1)[1])
                epochs.append(row)
                bar.update(1)
                bar.write(f"{label:34s} epoch {row['epoch']}: train loss {row['train_loss']:.4f}  "
                          f"test acc {row['test_accuracy']:.4f}  wall {row['wall_s']:6.1f} s  sent "
                          f"{row['bytes_sent'] / 2**20:8.2f} MiB / dense {row['bytes_dense'] / 2**20:8.2f}"
                          f" MiB per worker")
    if proc.returncode != 0:
        sys.stderr.write("".join(tail))
        raise SystemExit(f"{label}: horovodrun exited {proc.returncode}")
    return epochs


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| run | epochs | final train loss | test accuracy | wall s (train) | MiB sent / worker "
             "| MiB dense / worker | compression |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, rows in results.items():
        sent = sum(r["bytes_sent"] for r in rows)
        dense = sum(r["bytes_dense"] for r in rows)
        lines.append(f"| {label} | {len(rows)} | {rows[-1]['train_loss']:.4f} | "
                     f"{rows[-1]['test_accuracy']:.4f} | {sum(r['wall_s'] for r in rows):.1f} | "
                     f"{sent / 2**20:.2f} | {dense / 2**20:.2f} | {dense / sent:.1f}x |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in results.items():
        wall, acc = [0.0], [None]
        for r in rows:
            wall.append(wall[-1] + r["wall_s"])
            acc.append(r["test_accuracy"])
        ax.plot(wall[1:], acc[1:], marker="o", label=label)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("Fashion-MNIST MLP, 2 Horovod workers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--limit", type=int, default=0, help="training images to use (0: all 60,000)")
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "main"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tqdm(total=args.epochs * len(RUNS), desc="epochs", unit="epoch") as bar:
        for label, compression in RUNS.items():
            results[label] = launch(label, compression, args, bar)
    report = table(results)
    print("\n" + report)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(report + "\n")
    plot(results, os.path.join(args.out, "accuracy_vs_time.png"))
    print(f"\nresults: {args.out}/results.md, results.json, accuracy_vs_time.png")


if __name__ == "__main__":
    main()
