"""The main job (``make run``): Fashion-MNIST on 2 Horovod workers, in PyTorch and in TensorFlow, once
uncompressed (Horovod's own allreduce) and once with ``grace.topk(0.01)``, on a 100 Mbit/s emulated
link when run as root (unshaped localhost otherwise, said at the start); then the exchange workload
(ResNet-50's 25.6 M gradients, no model compute) on a 1 Gbit/s link, the same two, where the step time
is the fused exchange's; then ResNet-50's real forward and backward (16 synthetic 64x64 images per
worker) on the same link, the same two and one worker alone, where the figure is img/s per worker
against one worker alone. It is ``compare.py`` on three small matrices; each ends in its comparison
table, and writes CSV, markdown, JSON and plots under ``--out`` (the exchange's in
``<out>/exchange``, ResNet-50's in ``<out>/resnet50``)."""

from __future__ import annotations

import argparse
import os

from scripts import compare


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="steps per epoch and worker")
    parser.add_argument("--rate", default="100mbit", help="link rate when root (tc syntax)")
    parser.add_argument("--exchange-rate", default="1gbit", help="the exchange workload's link rate")
    parser.add_argument("--out", default=os.path.join(compare.ROOT, "out", "main"))
    args = parser.parse_args()
    compare.main(["--workloads", "mnist", "--frameworks", "torch,tf",
                  "--compressors", "fp32,topk:ratio=0.01", "--rates", args.rate, "--workers", "2",
                  "--epochs", str(args.epochs), "--steps", str(args.steps), "--out", args.out])
    compare.main(["--workloads", "exchange", "--frameworks", "torch,tf",
                  "--compressors", "fp32,topk:ratio=0.01", "--rates", args.exchange_rate,
                  "--workers", "2", "--out", os.path.join(args.out, "exchange")])
    compare.main(["--workloads", "resnet50", "--frameworks", "torch,tf", "--alone",
                  "--compressors", "fp32,topk:ratio=0.01", "--rates", args.exchange_rate,
                  "--workers", "2", "--epochs", "2", "--steps", "8",
                  "--out", os.path.join(args.out, "resnet50")])


if __name__ == "__main__":
    main()
