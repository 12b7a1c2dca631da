"""Why random-k at 1% does not reach Adam's uncompressed accuracy: remedies tried, measured.

With error feedback, random-k sends each element about every ``1 / ratio`` steps with all it
accumulated meanwhile. Adam divides an element's step by the root mean square of its recent
gradients, and a burst of ``d`` steps' worth every ``d`` steps has ``sqrt(d)`` times the root mean
square of its mean, so Adam's steps shrink by about ``sqrt(d)`` (docs/quality.md, "With Adam").
This study runs the remedies that would give Adam per-step magnitudes back, on the mnist
workload (the MLP 784-512-256-10, Adam lr 1e-3, 2 workers of 64, 10 passes over Fashion-MNIST by
default), with grace's own pipelines exchanging between 2 simulated workers in one process
(``InProcessGroup``, the collectives a real worker would run):

- ``--spread BETA``: each element's exchanged update is spread over the following steps before
  Adam sees it, an exponential average of gain one (``s = BETA s + (1 - BETA) update``; every
  burst still arrives in full, over about ``1 / (1 - BETA)`` steps);
- ``--freeze-variance-after STEPS``: the exchange is dense for ``STEPS``, then Adam's second moment
  is frozen and the compressed exchange begins, as 1-bit Adam does (Tang et al., ICML 2021), so that
  Adam divides by the dense gradients' root mean square instead of the bursts';
- and other settings of the compressor itself, by its spec: ``randomk:ratio=0.1``,
  ``randomk:memory=none``.

    .venv/bin/python scripts/study_sparse_adam.py --spec fp32
    .venv/bin/python scripts/study_sparse_adam.py --spec randomk --spread 0.9
    .venv/bin/python scripts/study_sparse_adam.py --spec randomk --freeze-variance-after 468

Prints the test accuracy after every pass, and a JSON line with all of them at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compare  # noqa: E402
import fashion_mnist  # noqa: E402

import grace  # noqa: E402
from grace.backends import InProcessGroup  # noqa: E402

WORKERS, BATCH = 2, 64
BETAS, EPS = (0.9, 0.999), 1e-8


class Adam:
    """Adam (Kingma and Ba, 2015) as ``torch.optim.Adam`` steps it, with a switch that freezes the
    second moment (no further updates, its bias correction fixed) from a given step on."""

    def __init__(self, params: list[torch.Tensor], lr: float):
        self.params, self.lr, self.step_count, self.frozen_at = params, lr, 0, None
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    def step(self, grads: list[torch.Tensor]) -> None:
        self.step_count += 1
        t = self.step_count
        b1, b2 = BETAS
        v_steps = t if self.frozen_at is None else self.frozen_at
        with torch.no_grad():
            for p, g, m, v in zip(self.params, grads, self.m, self.v):
                m.mul_(b1).add_(g, alpha=1 - b1)
                if self.frozen_at is None:
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** v_steps)
                p.sub_(self.lr * m_hat / (v_hat.sqrt() + EPS))


def spec_params(spec: str) -> dict:
    """``compare.py``'s compressor spec (``randomk:ratio=0.1;memory=none``) as ``from_params``'s dict."""
    return json.loads(compare.parse_compression(spec))


def run(spec: str, lr: float, spread: float | None, freeze_after: int | None, seed: int,
        passes: int = 10) -> list[float]:
    images, labels = map(torch.from_numpy, fashion_mnist.load("train"))
    test_images, test_labels = map(torch.from_numpy, fashion_mnist.load("test"))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    optimizer = Adam(params, lr)
    dense = spec == "fp32"
    pipelines = None if dense else [grace.from_params(spec_params(spec)) for _ in range(WORKERS)]
    fp32 = [grace.none() for _ in range(WORKERS)]  # the dense exchange of a warm-up
    group = InProcessGroup(WORKERS)
    smoothed = [torch.zeros_like(p) for p in params]
    order = torch.Generator().manual_seed(seed + 1)
    steps = len(images) // (WORKERS * BATCH)
    accuracies = []

    def exchange(rank: int, grads: list[torch.Tensor], compressed: bool) -> list[torch.Tensor]:
        pipeline = (pipelines if compressed else fp32)[rank]
        collectives = group.worker(rank)
        started = [pipeline.start_bucket([g], [name], collectives) for g, name in zip(grads, names)]
        return [r[0] for r in pipeline.finish_step(started, collectives, 1.0 / WORKERS)]

    with ThreadPoolExecutor(WORKERS) as pool:
        for _ in tqdm(range(passes), desc=spec, leave=False):
            permutation = torch.randperm(len(images), generator=order)
            for step in range(steps):
                grads = []
                for rank in range(WORKERS):
                    batch = permutation[(WORKERS * step + rank) * BATCH:(WORKERS * step + rank + 1) * BATCH]
                    model.zero_grad()
                    torch.nn.functional.cross_entropy(model(images[batch]), labels[batch]).backward()
                    grads.append([p.grad.clone() for p in params])
                compressed = not dense and (freeze_after is None or optimizer.step_count >= freeze_after)
                if compressed and freeze_after is not None and optimizer.frozen_at is None:
                    optimizer.frozen_at = optimizer.step_count
                results = list(pool.map(lambda r: exchange(r, grads[r], compressed), range(WORKERS)))
                update = results[0]  # every worker gets the same
                if spread is not None and compressed:
                    for s, u in zip(smoothed, update):
                        s.mul_(spread).add_(u, alpha=1 - spread)
                    update = [s.clone() for s in smoothed]
                optimizer.step(update)
            with torch.no_grad():
                accuracy = (model(test_images).argmax(1) == test_labels).float().mean().item()
            accuracies.append(round(accuracy, 4))
            print(f"{spec} pass {len(accuracies)}: test accuracy {accuracy:.4f}", flush=True)
    return accuracies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default="randomk", help="fp32, or a compare.py compressor spec")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--spread", type=float, default=None, metavar="BETA")
    parser.add_argument("--freeze-variance-after", type=int, default=None, metavar="STEPS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", type=int, default=10, help="passes over the training set")
    args = parser.parse_args(argv)
    if args.spread is not None and not 0 <= args.spread < 1:
        parser.error(f"--spread must be in [0, 1), got {args.spread}")
    if args.freeze_variance_after is not None and args.freeze_variance_after < 1:
        parser.error(f"--freeze-variance-after must be at least 1, got {args.freeze_variance_after}")
    if args.passes < 1:
        parser.error(f"--passes must be at least 1, got {args.passes}")
    torch.set_num_threads(1)
    accuracies = run(args.spec, args.lr, args.spread, args.freeze_variance_after, args.seed, args.passes)
    print(json.dumps({"spec": args.spec, "lr": args.lr, "spread": args.spread,
                      "freeze_variance_after": args.freeze_variance_after, "seed": args.seed,
                      "accuracy": accuracies}))


if __name__ == "__main__":
    main()
