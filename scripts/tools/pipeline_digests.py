"""What every compressor computes through the pipeline, as digests, in two checkouts: does a change
to the code around the algorithms (a restructuring) leave every result and every state the same,
bit for bit?

For each compressor and set-up (plain; SGD's momentum and Adam's moments taken over; a warm-up;
buckets joined; through the shards' owners; hierarchical; a sparse gradient's rows), simulated
workers in one process exchange six steps of gradients of seven shapes (a matrix, vectors, one
below ``min_numel``, an empty one, a 4-d kernel), one step with a NaN on one worker (rolled back),
half of the steps handing the gradients over to be written into. The digest is a SHA-256 of every
result, every worker's ``state_dict()`` and ``stats()``, the pipeline's ``repr``, its notices and
its buckets. A set-up a compressor refuses is listed as refused, with the first words of why.

    .venv/bin/python -m scripts.tools.pipeline_digests --before /tmp/old-checkout --after .

Prints the rows that differ (none, when nothing changed) and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

from scripts import ROOT
from scripts.tools.checkout_sides import assert_imported_from, measure_side

SHAPES = [(64, 300), (300,), (10,), (0,), (128, 64), (7, 7, 3, 3), (2000,)]
SETUPS = ("plain", "sgd", "adam", "warmup", "bucket", "alltoall", "hierarchical", "sparse")


def _digest(h, x) -> None:
    import numpy as np
    import torch

    from grace.sparse import Rows

    if isinstance(x, Rows):
        _digest(h, [x.indices, x.values])
    elif isinstance(x, (list, tuple)):
        for y in x:
            _digest(h, y)
    elif isinstance(x, dict):
        for key in sorted(x, key=str):
            h.update(str(key).encode())
            _digest(h, x[key])
    elif isinstance(x, torch.Tensor):
        h.update(x.detach().contiguous().numpy().tobytes())
    elif isinstance(x, np.ndarray):
        h.update(np.ascontiguousarray(x).tobytes())
    else:
        h.update(repr(x).encode())


def digest(name: str, setup: str) -> str:
    """The digest of six steps of ``name`` in ``setup`` (see the module docstring)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    import grace
    from grace.backends.numpy_collectives import InProcessGroup
    from grace.momentum import OptimizerMomentum
    from grace.sparse import Rows

    options = {"warmup": {"warmup_steps": 2}, "bucket": {"granularity": "bucket"},
               "alltoall": {"communicator": "alltoall"}, "hierarchical": {"hierarchical": True}}
    workers = 4 if setup in ("alltoall", "hierarchical") else 2
    try:
        pipelines = [grace.build(name, **options.get(setup, {})) for _ in range(workers)]
    except (ValueError, TypeError) as refused:
        return "refused: " + str(refused)[:40]
    group = InProcessGroup(workers, per_host=2 if setup == "hierarchical" else None)
    lines: list = []
    if setup == "sgd":
        lines = [p.take_momentum(OptimizerMomentum(0.9)) for p in pipelines]
    if setup == "adam":
        lines = [p.take_momentum(OptimizerMomentum(0.9, dampening=0.9), adam=True) for p in pipelines]
        lines += [p.take_adam_moments(0.999, 1e-8) for p in pipelines]
    h = hashlib.sha256()
    _digest(h, [lines, repr(pipelines[0]), pipelines[0].notices(workers, optimizer_seen=False)])
    ops = grace.ops_for(torch.zeros(1))
    names = [f"t{i}" for i in range(len(SHAPES))]
    buckets = pipelines[0].buckets([(s, "float32") for s in SHAPES], ops)
    _digest(h, buckets)

    def step(rank: int, index: int):
        generator = torch.Generator().manual_seed(1000 * index + rank)
        grads = [torch.randn(s, generator=generator) for s in SHAPES]
        if index == 3 and rank == 1:
            grads[0][0, 0] = float("nan")
        collectives, pipeline = group.worker(rank), pipelines[rank]
        started = [pipeline.start_bucket([grads[i] for i in b], [names[i] for i in b], collectives,
                                         overwrite=index % 2 == 0) for b in buckets]
        out = pipeline.finish_step(started, collectives, 1.0 / workers)
        if setup == "sparse":
            rows = Rows(torch.tensor([1, 3, 3, 7 + rank]), torch.randn(4, 5, generator=generator), (50, 5))
            out.append(pipeline.finish_step([pipeline.start_sparse(rows, "emb", collectives)],
                                            collectives, 1.0 / workers))
        return out

    with ThreadPoolExecutor(workers) as pool:
        for index in range(6):
            _digest(h, list(pool.map(lambda rank: step(rank, index), range(workers))))
    for pipeline in pipelines:
        _digest(h, [pipeline.state_dict(), pipeline.stats()])
    return h.hexdigest()[:16]


def digests(root: str, names: list[str] | None = None) -> dict[str, str]:
    """The digests of ``names`` (default: every compressor) in every set-up, through the checkout
    at ``root`` (which this process imports: its ``PYTHONPATH`` names it)."""
    import grace

    assert_imported_from(root)
    return {f"{setup} {name}": digest(name, setup) for setup in SETUPS
            for name in (names or grace.available())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the checkout before the change")
    parser.add_argument("--after", default=ROOT, help="the checkout after it (default: this one)")
    parser.add_argument("--compressors", default="",
                        help="comma-separated names (default: every compressor of the catalogue)")
    parser.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [name for name in args.compressors.split(",") if name]
    if args.measure:
        print(json.dumps(digests(args.measure, names)))
        return 0
    if not args.before:
        parser.error("--before DIR is needed: the checkout to compare with")
    found = {}
    for side in ("before", "after"):
        # --compressors only when asked: a checkout from before the option still answers.
        chosen = ["--compressors", args.compressors] if names else []
        found[side] = measure_side(__file__, getattr(args, side), *chosen)
    differ = [key for key in found["after"] if found["before"].get(key) != found["after"][key]]
    differ += [key for key in found["before"] if key not in found["after"]]
    refused = sum(1 for value in found["after"].values() if value.startswith("refused"))
    print(f"{len(found['after'])} compressor and set-up pairs ({refused} refused alike), "
          f"{len(differ)} differ")
    for key in differ:
        print(f"  {key}: before {found['before'].get(key)}, after {found['after'].get(key)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
