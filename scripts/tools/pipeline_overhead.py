"""The pipeline's own time for one step, in two checkouts side by side: did a change to the code
around the algorithms (a restructuring) make a step slower?

For each compression, two simulated workers in one process (threads, ``grace.backends``'
in-process collectives) each start every bucket of ResNet-50's gradients and finish the step
(``Pipeline.start_bucket`` and ``finish_step``, error feedback written into the gradients as the
PyTorch wrapper has it); the figure is the median over ``--steps`` steps (the first two left out)
of the slower worker's time. Each checkout runs in a process of its own, interleaved with the
other's, ``--repeats`` times; the table gives each side's median and the ratio after / before,
with the range of the repeats' ratios (the machine is noisy: time nothing while another job runs).

    .venv/bin/python -m scripts.tools.pipeline_overhead --before /tmp/old-checkout --after .
    git worktree add /tmp/old HEAD~1 && .venv/bin/python -m scripts.tools.pipeline_overhead --before /tmp/old

One side's measurement alone: ``--measure DIR`` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from scripts import ROOT
from scripts.tools.checkout_sides import assert_imported_from, take_turns

DEFAULT = "topk,dgc,powersgd,qsgd,none,fp16,randomk,efsignsgd"


def measure(root: str, names: list[str], steps: int) -> dict[str, float]:
    """Median ms of a step's exchange through the checkout at ``root`` (which this process imports:
    its ``PYTHONPATH`` names it)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    import grace
    from grace.backends.numpy_collectives import InProcessGroup

    torch.set_num_threads(1)
    ops = grace.ops_for(torch.zeros(1))
    assert_imported_from(root)
    from scripts.workloads import resnet50_shapes  # either checkout's: the shapes do not change

    shapes = [tuple(shape) for _, shape in resnet50_shapes()][::-1]  # backward's order
    names_of = [f"p{i}" for i in range(len(shapes))]
    out = {}
    for name in names:
        pipelines = [grace.build(name) for _ in range(2)]
        group = InProcessGroup(2)
        buckets = pipelines[0].buckets([(s, "float32") for s in shapes], ops)
        generator = torch.Generator().manual_seed(0)
        grads = [[torch.randn(s, generator=generator) * 0.01 for s in shapes] for _ in range(2)]

        def step(rank: int) -> float:
            collectives, pipeline = group.worker(rank), pipelines[rank]
            g = [t.clone() for t in grads[rank]]
            start = time.perf_counter()
            started = [pipeline.start_bucket([g[i] for i in b], [names_of[i] for i in b], collectives,
                                             ops, overwrite=True) for b in buckets]
            pipeline.finish_step(started, collectives, 0.5)
            return time.perf_counter() - start

        times = []
        with ThreadPoolExecutor(2) as pool:
            for index in range(steps + 2):
                slowest = max(pool.map(step, range(2)))
                if index >= 2:
                    times.append(slowest)
        out[name] = 1000 * statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the checkout before the change")
    parser.add_argument("--after", default=ROOT, help="the checkout after it (default: this one)")
    parser.add_argument("--compressors", default=DEFAULT)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.compressors.split(",")
    if args.measure:
        print(json.dumps(measure(args.measure, names, args.steps)))
        return
    if not args.before:
        parser.error("--before DIR is needed: the checkout to compare with")
    runs = take_turns(__file__, args.before, args.after, args.repeats, "--compressors",
                      args.compressors, "--steps", str(args.steps))
    print(f"ResNet-50's gradients, 2 in-process workers, median of {args.steps} steps, "
          f"{args.repeats} interleaved repeats")
    print("| compression | before ms | after ms | after / before | range of the repeats |")
    print("|---|---:|---:|---:|---|")
    for name in names:
        before = statistics.median(r[name] for r in runs["before"])
        after = statistics.median(r[name] for r in runs["after"])
        ratios = [a[name] / b[name] for b, a in zip(runs["before"], runs["after"])]
        print(f"| {name} | {before:.1f} | {after:.1f} | {after / before:.3f} | "
              f"{min(ratios):.2f}-{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
