"""The mnist workload trained by N simulated workers in one process, through grace's own pipelines.

A study tool for questions that need many runs, or more workers than this machine can time: the
MLP 784-512-256-10 of ``workloads.py`` on Fashion-MNIST, batches of 64 per worker, 10 passes by
default, with SGD (lr 0.05, momentum 0.9) or Adam (lr 1e-3). Each worker's gradients go through
the pipeline a user would build (``compare.py``'s spec: ``topk:ratio=0.01;communicator=alltoall``),
in buckets as the wrappers form them, and the workers exchange through ``InProcessGroup``: the
collectives a real worker would run (allreduce, allgather, all-to-all), computed in one process. The
optimizer's momentum is taken over where the compressor owns it, as the wrappers do. Used for:

- **random-k with Adam** (docs/quality.md, "With Adam"): the remedies that would give Adam
  per-step magnitudes back. ``--spread BETA`` spreads each element's exchanged update over the
  following steps before Adam sees it (an average of gain one, ``s = BETA s + (1 - BETA) update``:
  every burst still arrives in full, over about ``1 / (1 - BETA)`` steps);
  ``--freeze-variance-after STEPS`` exchanges dense for ``STEPS``, then freezes Adam's second
  moment and compresses, as 1-bit Adam does (Tang et al., ICML 2021), so that Adam divides by the
  dense gradients' root mean square instead of the bursts';
  ``--local-adam`` runs Adam on each worker's own (dense) gradients and exchanges its updates
  instead, with error feedback, then steps by the learning rate without further momentum, as
  Chen et al.'s quantized Adam with error feedback does (ACM TIST 2021): Adam then divides by the
  root mean square of dense gradients, and the bursts are of updates, not gradients.
  ``--held BETA`` replaces error feedback's bursts by a dense estimate that every worker keeps
  alike, as EF21 does (Richtárik et al., NeurIPS 2021; with momentum, EF21-SGDM, Fatkhullin et
  al., NeurIPS 2023): each worker keeps a momentum of its gradients ``v = BETA v + (1 - BETA) g``
  (``BETA`` 0: the gradient itself), the random-k entries of ``v`` are averaged, and each is held
  in the estimate, which the optimizer steps on every step, until it is drawn again. Adam then sees
  values of the gradient's own size on every step, however late.
- **random-k with Adam's moments taken over** (the default, as the wrappers do it:
  ``grace.second_moment``): the tensors random-k compresses step by ``lr * burst / (sqrt(v) +
  eps)`` with every worker's second moment ``v``, Adam the rest; the studies above keep Adam on the
  bursts, as before. ``randomk:take_adam_moments=False`` runs Adam on the bursts without them.
- **random-k's floor** (docs/quality.md, "With Adam"): which tensors its delay costs accuracy on
  (``randomk:min_kept=1;min_numel=4096`` sends the output layer dense) and how many entries of a
  small tensor to keep (``randomk:min_kept=K``).
- **the shards' owners against gathering at more workers** (docs/results.md, "Accuracy through the
  owners"): ``--workers 8``.

    .venv/bin/python -m scripts.studies.simulate_mnist --spec fp32 --optimizer adam
    .venv/bin/python -m scripts.studies.simulate_mnist --spec randomk --optimizer adam --spread 0.9
    .venv/bin/python -m scripts.studies.simulate_mnist --spec randomk --optimizer adam --held 0.9
    .venv/bin/python -m scripts.studies.simulate_mnist \
        --spec "topk:ratio=0.01;communicator=alltoall" --workers 8

Prints the test accuracy after every pass, and a JSON line with all of them at the end.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

import grace
from grace.backends import InProcessGroup
from grace.momentum import OptimizerMomentum
from grace.ops import ops_for
from scripts import compare, workloads
from scripts.compare_worker import ADAM_LR

MNIST = workloads.MNIST
BATCH, MOMENTUM = MNIST["batch"], MNIST["momentum"]
LEARNING_RATES = {"sgd": MNIST["lr"], "adam": ADAM_LR}  # as compare_worker.py trains the workload
BETAS, EPS = (0.9, 0.999), 1e-8


class AdamMoments:
    """Adam's moments (Kingma and Ba, 2015) over a stream of gradients, as ``torch.optim.Adam``
    keeps them: ``direction`` folds one step's gradients in and returns Adam's step direction,
    the bias-corrected ``m / (sqrt(v) + eps)``. Setting ``frozen_at`` to a step count freezes the
    second moment from there on (no further updates, its bias correction fixed)."""

    def __init__(self, params: list[torch.Tensor], beta1: float):
        self.beta1, self.step_count, self.frozen_at = beta1, 0, None
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    def direction(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        self.step_count += 1
        t, b1, b2 = self.step_count, self.beta1, BETAS[1]
        v_steps = t if self.frozen_at is None else self.frozen_at
        out = []
        with torch.no_grad():
            for g, m, v in zip(grads, self.m, self.v):
                m.mul_(b1).add_(g, alpha=1 - b1)
                if self.frozen_at is None:
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                out.append(m / (1 - b1 ** t) / ((v / (1 - b2 ** v_steps)).sqrt() + EPS))
        return out


class HeldEstimate:
    """EF21's dense estimate of the averaged gradient for random-k (``--held``): each worker's
    momentum ``v``, the entries random-k draws (the same on every worker, from the compressor's own
    shared draw) averaged and held until drawn again; tensors below ``min_numel`` go dense."""

    def __init__(self, pipeline: grace.Pipeline, params: list[torch.Tensor], workers: int,
                 beta: float):
        self.compressor, self.min_numel, self.beta = pipeline.compressor, pipeline.min_numel, beta
        self.momenta = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
        self.held = [torch.zeros_like(p) for p in params]
        self.steps = 0

    def exchange(self, grads: list[list[torch.Tensor]], names: list[str]) -> list[torch.Tensor]:
        with torch.no_grad():
            for momenta, worker_grads in zip(self.momenta, grads):
                for v, g in zip(momenta, worker_grads):
                    v.mul_(self.beta).add_(g, alpha=1 - self.beta)
            for i, (held, name) in enumerate(zip(self.held, names)):
                mean = torch.stack([momenta[i] for momenta in self.momenta]).mean(0).view(-1)
                flat = held.view(-1)
                if flat.numel() < self.min_numel:
                    flat.copy_(mean)
                    continue
                k = self.compressor.k(flat.numel())
                chosen = self.compressor.indices(flat.numel(), k, name, None, ops_for(flat),
                                                 like=flat, step=self.steps, shared=True)
                flat[chosen] = mean[chosen]
        self.steps += 1
        return [h.clone() for h in self.held]


class FreezableAdam(AdamMoments):
    """Adam as ``torch.optim.Adam`` steps it, with the moments' switch that freezes the second
    moment (``frozen_at``)."""

    def __init__(self, params: list[torch.Tensor], lr: float, beta1: float):
        super().__init__(params, beta1)
        self.params, self.lr = params, lr

    def step(self) -> None:
        with torch.no_grad():
            for p, d in zip(self.params, self.direction([p.grad for p in self.params])):
                p.sub_(self.lr * d)


def build_pipelines(spec: str, workers: int) -> list[grace.Pipeline] | None:
    """One pipeline per worker from ``compare.py``'s spec, or ``None`` for ``fp32``."""
    if spec == "fp32":
        return None
    params = json.loads(compare.parse_compression(spec))
    return [grace.from_params(params) for _ in range(workers)]


def take_momentum(pipelines: list[grace.Pipeline] | None, optimizer: str) -> float:
    """Hand the optimizer's momentum (SGD's, or Adam's ``beta_1``) to every worker's pipeline where
    its compressor owns it, as the wrappers do; returns the momentum the optimizer keeps."""
    if pipelines is None:
        return MOMENTUM
    adam = optimizer == "adam"
    found = OptimizerMomentum(MOMENTUM, dampening=MOMENTUM if adam else 0.0,
                              source="Adam's beta_1" if adam else "SGD's momentum")
    taken = [p.take_momentum(found, adam=adam) for p in pipelines]
    return 0.0 if taken[0] is not None else MOMENTUM


def run(spec: str, workers: int = 2, optimizer: str = "sgd", lr: float | None = None,
        spread: float | None = None, freeze_after: int | None = None, seed: int = 0,
        passes: int = 10, local_adam: bool = False, held: float | None = None) -> list[float]:
    """Train and return the test accuracy after each pass."""
    images, labels, test_images, test_labels = map(torch.from_numpy, workloads.fashion_mnist())
    torch.manual_seed(seed)
    widths = [images.shape[1], *MNIST["hidden"], 10]
    layers: list[torch.nn.Module] = []
    for inputs, outputs in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(inputs, outputs), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])  # no ReLU after the output layer
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    pipelines = build_pipelines(spec, workers)
    dense = [grace.none() for _ in range(workers)]  # fp32, and a warm-up's exchange
    kept = take_momentum(pipelines, optimizer)
    if optimizer == "adam" and pipelines is not None and not (
            local_adam or freeze_after is not None or spread is not None or held is not None):
        for pipeline in pipelines:  # as the wrappers do: torch.optim.Adam's betas[1] and eps
            pipeline.take_adam_moments(BETAS[1], EPS)  # the studies above keep Adam on the bursts
    lr = LEARNING_RATES[optimizer] if lr is None else lr
    local = [AdamMoments(params, kept) for _ in range(workers)] if local_adam else None
    if optimizer == "sgd" or local_adam:  # local Adam's exchanged updates step as plain SGD
        step_optimizer = torch.optim.SGD(params, lr, momentum=0.0 if local_adam else kept)
    elif freeze_after is None:
        step_optimizer = torch.optim.Adam(params, lr, betas=(kept, BETAS[1]))
    else:
        step_optimizer = FreezableAdam(params, lr, kept)
    ops = ops_for(params[0])
    steps_itself = [pipelines is not None and pipelines[0].steps_itself(tuple(p.shape), "float32", ops)
                    for p in params]
    order = [list(range(len(params)))[::-1]]  # backward's order: the last layer's first
    if pipelines is not None:
        ready = [params[i] for i in order[0]]
        order = [[order[0][j] for j in bucket] for bucket in
                 pipelines[0].buckets([(tuple(p.shape), "float32") for p in ready], ops)]
    group = InProcessGroup(workers)
    estimate = None if held is None else HeldEstimate(pipelines[0], params, workers, held)
    smoothed = [torch.zeros_like(p) for p in params]
    shuffle = torch.Generator().manual_seed(seed + 1)
    steps = len(images) // (workers * BATCH)
    accuracies = []

    def exchange(rank: int, grads: list[torch.Tensor], compressed: bool) -> list[torch.Tensor]:
        pipeline = (pipelines if compressed else dense)[rank]
        collectives = group.worker(rank)
        started = [pipeline.start_bucket([grads[i] for i in bucket], [names[i] for i in bucket],
                                         collectives) for bucket in order]
        results = pipeline.finish_step(started, collectives, 1.0 / workers)
        out: list = [None] * len(params)
        for bucket, tensors in zip(order, results):
            for i, tensor in zip(bucket, tensors):
                out[i] = tensor
        return out

    with ThreadPoolExecutor(workers) as pool:
        for _ in tqdm(range(passes), desc=spec, leave=False):
            permutation = torch.randperm(len(images), generator=shuffle)
            for step in range(steps):
                grads = []
                for rank in range(workers):
                    start = (workers * step + rank) * BATCH
                    batch = permutation[start:start + BATCH]
                    model.zero_grad()
                    torch.nn.functional.cross_entropy(model(images[batch]), labels[batch]).backward()
                    grads.append([p.grad.clone() for p in params])
                if local is not None:
                    grads = [worker.direction(g) for worker, g in zip(local, grads)]
                done = getattr(step_optimizer, "step_count", None)
                compressed = pipelines is not None and (freeze_after is None or done >= freeze_after)
                if compressed and freeze_after is not None and step_optimizer.frozen_at is None:
                    step_optimizer.frozen_at = done
                if estimate is not None:
                    update = estimate.exchange(grads, names)
                else:
                    results = list(pool.map(lambda r: exchange(r, grads[r], compressed),
                                            range(workers)))
                    update = results[0]  # every worker gets the same
                if spread is not None and compressed:
                    for s, u in zip(smoothed, update):
                        s.mul_(spread).add_(u, alpha=1 - spread)
                    update = [s.clone() for s in smoothed]
                for p, u, itself in zip(params, update, steps_itself):
                    p.grad = None if itself else u
                    if itself:  # Adam's moments taken over: the update, stepped by the rate
                        with torch.no_grad():
                            p.sub_(lr * u)
                step_optimizer.step()
            with torch.no_grad():
                accuracy = (model(test_images).argmax(1) == test_labels).float().mean().item()
            accuracies.append(round(accuracy, 4))
            print(f"{spec} pass {len(accuracies)}: test accuracy {accuracy:.4f}", flush=True)
    return accuracies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default="randomk", help="fp32, or a compare.py compressor spec")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--optimizer", choices=sorted(LEARNING_RATES), default="sgd")
    parser.add_argument("--lr", type=float, default=None, help="the workload's for the optimizer")
    parser.add_argument("--spread", type=float, default=None, metavar="BETA")
    parser.add_argument("--freeze-variance-after", type=int, default=None, metavar="STEPS")
    parser.add_argument("--local-adam", action="store_true",
                        help="each worker's Adam on its own gradients; exchange its updates")
    parser.add_argument("--held", type=float, default=None, metavar="BETA",
                        help="random-k: a dense estimate, EF21's, of momentum BETA's entries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", type=int, default=10, help="passes over the training set")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.spread is not None and not 0 <= args.spread < 1:
        parser.error(f"--spread must be in [0, 1), got {args.spread}")
    if args.freeze_variance_after is not None and args.freeze_variance_after < 1:
        parser.error(f"--freeze-variance-after must be at least 1, got {args.freeze_variance_after}")
    if args.freeze_variance_after is not None and args.optimizer != "adam":
        parser.error("--freeze-variance-after freezes Adam's second moment: it needs --optimizer adam")
    if args.local_adam and (args.optimizer != "adam" or args.spread is not None
                            or args.freeze_variance_after is not None):
        parser.error("--local-adam needs --optimizer adam, without --spread or --freeze-variance-after")
    if args.held is not None and (not 0 <= args.held < 1 or not args.spec.startswith("randomk")
                                  or args.spread is not None or args.local_adam
                                  or args.freeze_variance_after is not None):
        parser.error(f"--held needs a randomk spec, a BETA in [0, 1) (got {args.held}), and none "
                     "of --spread, --local-adam, --freeze-variance-after")
    if args.passes < 1:
        parser.error(f"--passes must be at least 1, got {args.passes}")
    torch.set_num_threads(1)
    accuracies = run(args.spec, args.workers, args.optimizer, args.lr, args.spread,
                     args.freeze_variance_after, args.seed, args.passes, args.local_adam,
                     args.held)
    print(json.dumps({"spec": args.spec, "workers": args.workers, "optimizer": args.optimizer,
                      "lr": args.lr, "spread": args.spread,
                      "freeze_variance_after": args.freeze_variance_after,
                      "local_adam": args.local_adam, "held": args.held, "seed": args.seed,
                      "accuracy": accuracies}))


if __name__ == "__main__":
    main()
