"""One worker of the main job: an MLP on Fashion-MNIST with Horovod's DistributedOptimizer, either
uncompressed (Horovod's own allreduce) or with a grace compressor. Rank 0 prints one JSON line per
epoch prefixed with ``EPOCH``; ``scripts/run_main.py`` launches it and compares.

    horovodrun -np 2 python scripts/train_fashion_mnist.py \
        --compression '{"compressor": "topk", "ratio": 0.01}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fashion_mnist  # noqa: E402
import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import grace  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--compression", default="",
                        help="grace.from_params JSON; empty: Horovod's own uncompressed allreduce")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--limit", type=int, default=0, help="use only this many training images")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def evaluate(model, images, labels):
    """Accuracy over the whole test set, each worker scoring its share."""
    share = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        logits = model(torch.from_numpy(images[share]))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels[share]), reduction="sum")
        correct = (logits.argmax(1).numpy() == labels[share]).sum()
    totals = hvd.allreduce(torch.tensor([float(correct), float(loss), float(len(labels[share]))],
                                        dtype=torch.float64), op=hvd.Sum, name="eval")
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_x, train_y = fashion_mnist.load("train")
    test_x, test_y = fashion_mnist.load("test")
    if args.limit:
        train_x, train_y = train_x[:args.limit], train_y[:args.limit]

    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    compression = grace.from_params(json.loads(args.compression)) if args.compression else None
    kwargs = {"compression": compression} if compression is not None else {}
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    dense_per_step = sum(p.numel() * p.element_size() for p in model.parameters())

    rng = np.random.default_rng(args.seed)
    sent_before = dense_before = 0
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(train_x))[hvd.rank()::hvd.size()]
        steps = len(order) // args.batch_size
        model.train()
        start, total_loss = time.perf_counter(), 0.0
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(train_x[idx])),
                                                     torch.from_numpy(train_y[idx]))
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
        wall = time.perf_counter() - start
        if compression is not None:
            stats = compression.stats()
            sent, dense = stats["bytes_sent"] - sent_before, stats["bytes_dense"] - dense_before
            sent_before, dense_before = stats["bytes_sent"], stats["bytes_dense"]
        else:
            sent = dense = dense_per_step * steps
        train_loss = float(hvd.allreduce(torch.tensor(total_loss / steps), name="loss"))
        accuracy, test_loss = evaluate(model.eval(), test_x, test_y)
        if hvd.rank() == 0:
            print("EPOCH " + json.dumps({
                "epoch": epoch, "train_loss": train_loss, "test_loss": test_loss,
                "test_accuracy": accuracy, "wall_s": wall, "steps": steps,
                "bytes_sent": sent, "bytes_dense": dense}), flush=True)


if __name__ == "__main__":
    main()
