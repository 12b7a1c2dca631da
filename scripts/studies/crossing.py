"""TensorFlow's exchange step with grace's loops crossing into the host from several sizes, timed in
pairs within one process: where the step's compression turns from TensorFlow's own kernels to
``tf.numpy_function`` calls of grace/native (``grace.native.CROSSING_MIN_NUMEL``).

    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m scripts.studies.crossing \\
        --compression efsignsgd --crossings 262144,65536 --rounds 16

Steps of separate processes on this shared 2-core machine differ by 10-30% from run to run, more
than the choice measured here. So each crossing gets its own variables, optimizer and traced step in
one process, the steps run in turns (``--steps`` of each per round), and each round's time is
divided by that of the first crossing in the same round: the median of those ratios, with its
quartiles, is what to read. The gradients are the exchange workload's (ResNet-50's shapes, or the
first ``--layers`` of them), SGD at learning rate 0, as in ``scripts/compare.py``; one thread per
worker. Rank 0 prints the table and, with ``--out``, writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from tqdm import tqdm

import grace
from grace import native
from scripts import workloads
from scripts.compare import parse_compression
from scripts.compare_worker import exchange_loss


def build_step(shapes, fixed, params: dict, crossing: int):
    """A traced exchange step whose loops cross into the host from ``crossing`` elements: the
    threshold is read when the step is traced, on its first call, made here."""
    native.CROSSING_MIN_NUMEL = crossing
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.0), compression=grace.from_params(params))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = exchange_loss(variables, fixed)
        optimizer.apply(tape.gradient(loss, variables), variables)

    step()
    return step, traced_ops(step)


def traced_ops(step) -> int:
    """How many operations the traced step holds, those of its branches and nested functions
    included: what TensorFlow's executor schedules one by one (constants and all)."""
    graph = step.get_concrete_function().graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compression", required=True, help="as compare.py takes it, e.g. topk:ratio=0.01")
    parser.add_argument("--crossings", default="262144,65536",
                        help="element counts, comma-separated; ratios are to the first")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="steps of each crossing per round")
    parser.add_argument("--layers", type=int, default=0, help="the first N of ResNet-50's shapes (0: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    crossings = [int(c) for c in args.crossings.split(",")]
    if any(c < 1 for c in crossings):
        parser.error(f"--crossings: element counts of at least 1, got {args.crossings}")
    params = json.loads(parse_compression(args.compression))

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    shapes = [s for _, s in workloads.resnet50_shapes()]
    shapes = shapes[:args.layers] if args.layers else shapes
    rng = np.random.default_rng(hvd.rank())
    fixed = [tf.constant(rng.standard_normal(s, np.float32) * 1e-3) for s in shapes]
    chosen = native.CROSSING_MIN_NUMEL
    try:
        built = [build_step(shapes, fixed, params, c) for c in crossings]
    finally:
        native.CROSSING_MIN_NUMEL = chosen
    times: list[list[float]] = [[] for _ in crossings]
    for _ in tqdm(range(args.rounds), desc=args.compression, disable=hvd.rank() != 0):
        for (step, _), spent in zip(built, times):
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            spent.append((time.perf_counter() - start) / args.steps)
    rows = []
    for c, (_, calls), spent in zip(crossings, built, times):
        ratios = [t / first for t, first in zip(spent, times[0])]
        low, median, high = statistics.quantiles(ratios, n=4, method="inclusive")
        rows.append({"crossing": c, "traced_ops": calls,
                     "step_ms": 1e3 * statistics.median(spent),
                     "ratio": median, "ratio_q1": low, "ratio_q3": high})
    result = {"compression": args.compression, "workers": hvd.size(), "rounds": args.rounds,
              "layers": len(shapes), "rows": rows}
    if hvd.rank() == 0:
        print(f"| {args.compression}, {hvd.size()} workers | operations traced | step (median) | "
              f"against {crossings[0]} (median, quartiles) |\n|---|---:|---:|---:|")
        for r in rows:
            print(f"| from {r['crossing']} elements | {r['traced_ops']} | {r['step_ms']:.1f} ms | "
                  f"{r['ratio']:.3f} ({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}) |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
