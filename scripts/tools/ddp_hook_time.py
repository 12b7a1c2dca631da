"""The DDP hook's own time: how long each step spends inside ``grace.ddp_hook``, on ResNet-50's
real forward and backward, one worker alone (no communication to wait for), for the compressors
given, in this checkout or in two side by side.

On one worker the time inside the hook is grace's own work on the core: joining, encoding, the
(trivial) collective, decoding and writing the results back into DDP's bucket (the step's finish
runs in its last bucket's call). It is what a faster link leaves exposed. With ``--before DIR`` the
two checkouts run in turn, round after round, each round a fresh process per checkout and
compressor, and the medians are printed side by side (the machine is noisy: compare only what
ran interleaved). ``--json FILE`` keeps the samples, from which ``markdown`` (and
``scripts.doc_tables``'s ``ddp_hook_time`` table) prints the same table.

    python -m scripts.tools.ddp_hook_time --compressors none,fp16 --before /tmp/before --json F
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from tqdm import tqdm

from scripts import ROOT
from scripts.tools.checkout_sides import assert_imported_from, measure_side


def measure(compressor: str, steps: int, warmup: int, image: int, batch: int) -> list[float]:
    """Milliseconds inside the hook per step, for ``steps`` steps after ``warmup``."""
    import os
    import tempfile
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import grace
    from frameworks.torch import ddp as hook_module
    from scripts.resnet import ResNet50

    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="grace-hook-time-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    spent = [0.0]
    on_bucket = hook_module.DDPState.on_bucket

    def timed(state, bucket):
        start = time.perf_counter()
        try:
            return on_bucket(state, bucket)
        finally:
            spent[0] += time.perf_counter() - start

    hook_module.DDPState.on_bucket = timed
    torch.manual_seed(0)
    model = DDP(ResNet50())
    model.register_comm_hook(grace.build(compressor), grace.ddp_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, 1000, (batch,))
    per_step = []
    for step in range(warmup + steps):
        spent[0] = 0.0
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if step >= warmup:
            per_step.append(1000 * spent[0])
    dist.destroy_process_group()
    if os.path.exists(store):
        os.remove(store)
    return per_step


def markdown(data: dict) -> str:
    """The medians of a run (``--json``'s file), a column per checkout."""
    lines = [f"ms a step inside grace.ddp_hook, ResNet-50 {data['image']}x{data['image']}, batch "
             f"{data['batch']}, one worker, one thread; the median of {data['rounds']} rounds of "
             f"{data['steps']} steps", "",
             "| compressor | " + " | ".join(data["sides"]) + " |",
             "|---|" + "---:|" * len(data["sides"])]
    for name, by_side in data["samples"].items():
        cells = [f"{statistics.median(by_side[side]):.1f}" for side in data["sides"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressors", default="none,fp16")
    parser.add_argument("--before", help="a checkout to run beside this one, round after round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", metavar="FILE", help="keep the settings and every sample here")
    parser.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [n for n in args.compressors.split(",") if n]
    if args.measure:
        assert_imported_from(args.measure)
        print(json.dumps(measure(names[0], args.steps, args.warmup, args.image, args.batch)))
        return 0
    sides = {"before": args.before, "after": ROOT} if args.before else {"this checkout": ROOT}
    found: dict = {(side, name): [] for side in sides for name in names}
    settings = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--image",
                str(args.image), "--batch", str(args.batch)]
    runs = [(side, name) for _ in range(args.rounds) for name in names for side in sides]
    for side, name in tqdm(runs, desc="runs", file=sys.stderr):
        found[(side, name)] += measure_side(__file__, sides[side], "--compressors", name, *settings)
    data = {"image": args.image, "batch": args.batch, "rounds": args.rounds, "steps": args.steps,
            "sides": list(sides), "samples": {name: {side: found[(side, name)] for side in sides}
                                              for name in names}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
