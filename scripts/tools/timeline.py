"""One training step's timeline on 2 Horovod workers: the backward pass, each bucket's compression
(``start_bucket``: error feedback, encoding, packing, issuing its collective) and the time its
collective is in flight until the optimizer collects it (``finish_step``). It shows the buckets
starting while backward is still running.

    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m scripts.tools.timeline \\
        --out data/results/fused/timeline

``--model mlp``: a 12-layer MLP (1024 wide, 12.6 M parameters) on random data, SGD,
``grace.topk(0.01)`` with ``bucket_bytes`` of 8 MiB (so that its 48 MiB of gradients make several
buckets). ``--model resnet50``: the end-to-end workload's ResNet-50 (``scripts/resnet.py``, 16
synthetic 64x64 images per worker, SGD with momentum 0.9) with the pipeline's own bucket size unless
``--bucket-mib`` says otherwise. ``--compression`` is a ``grace.from_params`` JSON object. The step
shown is the median of ``--steps`` steps by duration. Rank 0 writes ``<out>.json`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import horovod.torch as hvd
import torch

import grace


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="out/timeline")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--model", choices=("mlp", "resnet50"), default="mlp")
    parser.add_argument("--compression", default='{"compressor": "topk", "ratio": 0.01}')
    parser.add_argument("--bucket-mib", type=float, default=None,
                        help="bucket_bytes in MiB (default: 8 for the MLP, the pipeline's own for "
                             "ResNet-50)")
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(hvd.rank())
    torch.set_num_threads(1)
    params = json.loads(args.compression)
    if args.bucket_mib is not None or args.model == "mlp":
        params["bucket_bytes"] = int((args.bucket_mib or 8.0) * 2**20)
    pipeline = grace.from_params(params)
    if args.model == "mlp":
        layers = [torch.nn.Linear(1024, 1024) for _ in range(12)]
        model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())])
        x, y = torch.randn(256, 1024), torch.randn(256, 1024)
        loss_of = torch.nn.functional.mse_loss
        base = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        from scripts.resnet import ResNet50

        model = ResNet50()
        x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 1000, (16,))
        loss_of = torch.nn.functional.cross_entropy
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                         compression=pipeline)
    events: list = []
    clock = time.perf_counter

    start_bucket, finish_step = pipeline.start_bucket, pipeline.finish_step

    def timed_start(tensors, names, group, ops=None, **options):
        began = clock()
        exchange = start_bucket(tensors, names, group, ops, **options)
        events.append(("compress", exchange.tag, began, clock()))
        return exchange

    def timed_finish(exchanges, group, scale=1.0, carried=()):
        began = clock()
        results = finish_step(exchanges, group, scale, carried)
        events.append(("collect", "", began, clock()))
        return results

    pipeline.start_bucket, pipeline.finish_step = timed_start, timed_finish

    # When each collective completes: one thread polls the handles in flight every millisecond
    # (polling does not consume a result, which the optimizer collects later as usual).
    collectives = optimizer._collectives
    in_flight: dict = {}
    lock = threading.Lock()

    def watch():
        while True:
            with lock:
                for handle, (name, issued) in list(in_flight.items()):
                    try:
                        done = hvd.poll(handle)
                    except ValueError:  # already collected by the optimizer: done by now
                        done = True
                    if done:
                        events.append(("wire", name, issued, clock()))
                        del in_flight[handle]
            time.sleep(0.001)

    def watched(issue):
        def start(tensor, name, *rest):
            handle = issue(tensor, name, *rest)
            with lock:
                in_flight[handle] = (name, clock())
            return handle
        return start

    collectives.allreduce_async = watched(collectives.allreduce_async)
    collectives.allgather_async = watched(collectives.allgather_async)
    threading.Thread(target=watch, daemon=True).start()
    steps = []
    for _ in range(args.steps):
        events.clear()
        optimizer.zero_grad()
        t0 = clock()
        loss = loss_of(model(x), y)
        forward_end = clock()
        loss.backward()
        backward_end = clock()
        optimizer.step()
        step_end = clock()
        while in_flight:
            time.sleep(0.001)
        steps.append({"forward": [0.0, forward_end - t0],
                      "backward": [forward_end - t0, backward_end - t0], "step_end": step_end - t0,
                      "events": [(kind, tag, a - t0, b - t0) for kind, tag, a, b in events]})
    if hvd.rank() == 0:
        steps = steps[1:]  # the first step negotiates every collective once
        shown = sorted(steps, key=lambda s: s["step_end"])[len(steps) // 2]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"steps": steps, "shown": shown}, f, indent=1)
        plot(shown, args.out + ".png", f"{args.model}, {args.compression}, {hvd.size()} workers")
        buckets = [e for e in shown["events"] if e[0] == "compress"]
        during = sum(1 for e in buckets if e[2] < shown["backward"][1])
        backward = shown["backward"][1] - shown["backward"][0]
        print(f"step {shown['step_end'] * 1e3:.1f} ms; backward {backward * 1e3:.1f} ms; "
              f"{len(buckets)} buckets, {during} started during backward; wrote {args.out}.png")


def plot(step: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = [e for e in step["events"] if e[0] == "compress"]
    wires = {tag: (a, b) for kind, tag, a, b in step["events"] if kind == "wire"}
    collect = next(e for e in step["events"] if e[0] == "collect")
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.45 * (len(buckets) + 1)))
    ms = 1e3
    rows = len(buckets)
    ax.broken_barh([(step["forward"][0] * ms, (step["forward"][1] - step["forward"][0]) * ms)],
                   (rows - 0.4, 0.8), color="tab:gray", label="forward")
    ax.broken_barh([(step["backward"][0] * ms, (step["backward"][1] - step["backward"][0]) * ms)],
                   (rows - 0.4, 0.8), color="tab:blue", label="backward")
    ax.broken_barh([(collect[2] * ms, (collect[3] - collect[2]) * ms)], (rows - 0.4, 0.8),
                   color="tab:purple", label="optimizer.step(): wait, decompress, aggregate")
    for i, (_, tag, a, b) in enumerate(buckets):
        row = rows - 1 - i
        ax.broken_barh([(a * ms, (b - a) * ms)], (row - 0.3, 0.6), color="tab:orange",
                       label="compression and packing (start_bucket)" if i == 0 else None)
        for name, (issued, done) in wires.items():
            if name.startswith(tag + "."):
                ax.broken_barh([(issued * ms, (done - issued) * ms)], (row - 0.15, 0.3),
                               color="tab:green", label="collective in flight" if i == 0 else None)
    ax.set_yticks(range(rows + 1))
    ax.set_yticklabels([f"bucket {rows - r}" for r in range(rows)] + ["model"])
    ax.set_xlabel("ms since the step began (rank 0)")
    ax.set_title(f"One step: {title}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
