"""The main job (``make run``): Fashion-MNIST on 2 Horovod workers, in PyTorch and in TensorFlow, once
uncompressed (Horovod's own allreduce) and once with ``grace.topk(0.01)``, on a 100 Mbit/s emulated
link when run as root (unshaped localhost otherwise, said at the start). It is ``compare.py`` on a
small matrix; it ends in the comparison table, and writes CSV, markdown, JSON and plots under
``--out``."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="steps per epoch and worker")
    parser.add_argument("--rate", default="100mbit", help="link rate when root (tc syntax)")
    parser.add_argument("--out", default=os.path.join(compare.ROOT, "out", "main"))
    args = parser.parse_args()
    compare.main(["--workloads", "mnist", "--frameworks", "torch,tf",
                  "--compressors", "fp32,topk:ratio=0.01", "--rates", args.rate, "--workers", "2",
                  "--epochs", str(args.epochs), "--steps", str(args.steps), "--out", args.out])


if __name__ == "__main__":
    main()
