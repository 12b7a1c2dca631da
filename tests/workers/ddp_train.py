"""Worker for tests/test_ddp.py: trains under PyTorch DDP with grace's communication hook and saves
each rank's final weights, compression stats and what it saw.

Run by ``torchrun --nproc_per_node=2 tests/workers/ddp_train.py OUTDIR [--scenarios a,b]``. No
Horovod is imported: a DDP user needs none."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import grace
from tests.workers import sparse_model
from tests.workers.common import CATALOGUE_LR, LR, batch, torch_linear

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("--scenarios", default="all")
parser.add_argument("--backend", default="gloo")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group(args.backend)
rank, size = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.backend == "nccl" \
    else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)  # NCCL's object collectives use the current device
STEPS = 10


def save(name, weights: dict, info: dict) -> None:
    np.savez(os.path.join(args.outdir, f"{name}.rank{rank}.npz"),
             **{k: v.detach().cpu().double().numpy() for k, v in weights.items()})
    with open(os.path.join(args.outdir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(info, f)


def linear_ddp(compression, named=False, **options):
    """The linear model under DDP with grace's hook; ``named``: its state named as the model names
    its parameters (``grace.DDPState``), as Horovod's ``named_parameters=`` does."""
    model = torch_linear(0).to(device)
    ddp = DDP(model, **options)
    state = grace.DDPState(compression, named_parameters=model.named_parameters()) if named \
        else compression
    ddp.register_comm_hook(state, grace.ddp_hook)
    return model, ddp


def train_linear(ddp, opt, steps, first=0, passes=1, poison=None, skip=()):
    """Steps ``first..steps-1`` on this rank's batches (``passes`` micro-batches each, all but the
    last under ``no_sync``); at step ``poison`` the last rank's loss is multiplied by inf. A step whose
    gradients are not finite is skipped, as a loss scaler does; steps in ``skip`` are not run."""
    skipped = []
    for step in range(first, steps):
        if step in skip:
            continue
        opt.zero_grad()
        for micro in range(passes):
            x, y = (torch.from_numpy(a).to(device) for a in batch(rank, step * passes + micro))
            # DDP's no_sync() must hold the forward pass too: it decides there what backward does.
            with ddp.no_sync() if micro < passes - 1 else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                if step == poison and rank == size - 1:
                    loss = loss * float("inf")
                loss.backward()
        if all(torch.isfinite(p.grad).all() for p in ddp.parameters()):
            opt.step()
        else:
            skipped.append(step)
    return skipped


def linear_scenario(name, make, passes=1, poison=None, skip=(), lr=LR, named=False, **options):
    compression = make()
    model, ddp = linear_ddp(compression, named, **options)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    skipped = train_linear(ddp, opt, STEPS, passes=passes, poison=poison, skip=skip)
    save(name, {"w": model.weight, "b": model.bias},
         {"stats": compression.stats(), "skipped": skipped})


def resume(name="resume", make=lambda: grace.topk(0.05)):
    """Five steps, the compression state saved (and the model's and optimizer's), a new DDP model
    and a new pipeline loaded from them, five more steps."""
    compression = make()
    model, ddp = linear_ddp(compression)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    train_linear(ddp, opt, 5)
    saved = {"model": model.state_dict(), "opt": opt.state_dict(),
             "grace": compression.state_dict()}
    path = os.path.join(args.outdir, f"{name}.rank{rank}.pt")
    torch.save(saved, path)
    del model, ddp, opt, compression
    loaded = torch.load(path, weights_only=False)
    compression = make()
    compression.load_state_dict(loaded["grace"])
    model = torch_linear(0).to(device)
    model.load_state_dict(loaded["model"])
    ddp = DDP(model)
    ddp.register_comm_hook(compression, grace.ddp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.load_state_dict(loaded["opt"])
    train_linear(ddp, opt, STEPS, first=5)
    save(name, {"w": model.weight, "b": model.bias}, {"stats": compression.stats()})


class Tower(torch.nn.Module):
    """Layers of different shapes, registered in the reverse of the order forward uses them, so
    that the order in which backward makes the gradients differs from DDP's first guess (reverse
    registration): DDP rebuilds its buckets after the first iteration into other groups."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(150, 8), torch.nn.Linear(170, 150),
                                           torch.nn.Linear(140, 170), torch.nn.Linear(160, 140)])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)

    def forward(self, x):
        for layer in (self.layers[3], self.layers[2], self.layers[1]):
            x = torch.tanh(layer(x))
        return self.layers[0](x)


def tower(name, bucket_cap_mb, poison=None, skip=(), make=lambda: grace.topk(0.05), named=False,
          frozen_biases=False, **options):
    """The tower trained with ``make()``'s compression: per-tensor compression does not depend on
    how DDP buckets the tensors, so every bucket size gives the same weights, bit for bit, if every
    residual stays with its parameter when DDP rebuilds its buckets. ``poison``: at that step the
    last rank's gradient of one weight (in a bucket of its own with small buckets) is made
    infinite; ``skip``: steps not run; ``named``: the state named by the model's parameter names
    (a stochastic compressor draws per name); ``frozen_biases``: only the weights are trained."""
    compression = make()
    model = Tower().to(device)
    for layer in model.layers if frozen_biases else ():
        layer.bias.requires_grad_(False)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, **options)
    layouts, finite = [], []
    names = {id(p): n for n, p in model.named_parameters()}

    def hook(state, bucket):
        layouts[-1].append([names[id(p)] for p in bucket.parameters()])
        return grace.ddp_hook(state, bucket)
    state = grace.DDPState(compression, named_parameters=model.named_parameters()) if named \
        else compression
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(6):
        if step in skip:
            continue
        layouts.append([])
        x, y = (torch.from_numpy(a).to(device) for a in batch(rank, step))
        opt.zero_grad()
        handle = None
        if step == poison and rank == size - 1:
            handle = model.layers[2].weight.register_hook(lambda g: g * float("inf"))
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        if handle is not None:
            handle.remove()
        finite.append([bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                       if p.requires_grad])
        if all(finite[-1]):
            opt.step()
    residuals = compression.state_dict().get("memory", {}).get("residuals", {})
    save(name, dict(model.named_parameters()),
         {"stats": compression.stats(), "layouts": layouts, "finite": finite,
          "residual_names": sorted(residuals)})


def in_place(name, make):
    """The tower with ``make()``'s compression, DDP's default buckets, 6 steps, counting what the
    hook does with each bucket: the collectives given a tensor to sum in place and those that sum
    a copy (``DistributedCollectives``), and the results the hook had to write into DDP's bucket
    (``ddp._write_into``: those not already at their place)."""
    from frameworks.torch import ddp as hook_module
    from frameworks.torch.distributed import DistributedCollectives

    counts = {"given": 0, "copied": 0, "written": 0, "in_place": 0}
    given, copied = DistributedCollectives.allreduce_given_async, DistributedCollectives.allreduce_async
    write = hook_module._write_into

    def counting_given(self, tensor, tag):
        counts["given"] += 1
        return given(self, tensor, tag)

    def counting_copied(self, tensor, tag):
        counts["copied"] += 1
        return copied(self, tensor, tag)

    def counting_write(buffer, tensors):
        offset = 0
        for tensor in tensors:
            at_place = (tensor.data_ptr() == buffer[offset:].data_ptr() and tensor.is_contiguous())
            counts["in_place" if at_place else "written"] += 1
            offset += tensor.numel()
        write(buffer, tensors)

    DistributedCollectives.allreduce_given_async = counting_given
    DistributedCollectives.allreduce_async = counting_copied
    hook_module._write_into = counting_write
    try:
        tower(name, 25, make=make)
    finally:
        DistributedCollectives.allreduce_given_async = given
        DistributedCollectives.allreduce_async = copied
        hook_module._write_into = write
    with open(os.path.join(args.outdir, f"{name}.counts.rank{rank}.json"), "w") as f:
        json.dump(counts, f)


class Bag(torch.nn.Module):
    """tests/workers/sparse_model.py's model: an embedding (1000 x 16, sparse gradients) whose
    looked-up rows are weighed and summed, and a linear layer."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(sparse_model.TABLE, sparse_model.WIDTH, sparse=True)
        self.linear = torch.nn.Linear(sparse_model.WIDTH, sparse_model.CLASSES, bias=False)
        table, linear = sparse_model.initial_weights()
        with torch.no_grad():
            self.embedding.weight.copy_(torch.from_numpy(table))
            self.linear.weight.copy_(torch.from_numpy(linear))

    def forward(self, x):
        weights = torch.from_numpy(sparse_model.POSITION.astype(np.float32)).reshape(1, -1, 1)
        return self.linear((self.embedding(x) * weights.to(x.device)).sum(1))


def rows(name, make):
    """Five SGD steps of the embedding model: its gradient sparse, its own DDP bucket, its rows
    exchanged (tests/test_sparse_workers.py does the same under Horovod)."""
    compression = make()
    model = Bag().to(device)
    ddp = DDP(model)
    ddp.register_comm_hook(compression, grace.ddp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=sparse_model.LR)
    sparse = []
    for step in range(5):
        x, t = (torch.from_numpy(a).to(device) for a in sparse_model.batch(step, rank))
        opt.zero_grad()
        ((ddp(x) - t) ** 2).mean().backward()
        sparse.append(model.embedding.weight.grad.is_sparse)
        opt.step()
    save(name, {"E": model.embedding.weight, "W": model.linear.weight},
         {"stats": compression.stats(), "sparse": sparse})


def errors():
    """What a user gets wrong, each a clear error from backward() or from building the state."""
    found = {}

    def attempt(key, run):
        try:
            run()
            found[key] = None
        except Exception as error:
            found[key] = f"{type(error).__name__}: {error}"

    def sparse_hierarchical():
        embedding = torch.nn.Embedding(50, 4, sparse=True).to(device)
        ddp = DDP(embedding)
        ddp.register_comm_hook(grace.topk(0.05, hierarchical=True), grace.ddp_hook)
        for _ in range(2):  # the first step is DDP's own allreduce under hierarchical=True
            ddp(torch.tensor([[1, 2]], device=device)).sum().backward()
    if "LOCAL_WORLD_SIZE" in os.environ:
        attempt("sparse_hierarchical", sparse_hierarchical)

    def unnamed():
        model = torch_linear(0).to(device)
        ddp = DDP(model)
        state = grace.DDPState(grace.topk(0.05), named_parameters=[("weight", model.weight)])
        ddp.register_comm_hook(state, grace.ddp_hook)
        x, y = (torch.from_numpy(a).to(device) for a in batch(rank, 0))
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    attempt("unnamed", unnamed)

    def reused():
        compression = grace.topk(0.05)
        for _ in range(2):  # a second model, the same compression object
            model = torch_linear(0).to(device)
            ddp = DDP(model)
            ddp.register_comm_hook(compression, grace.ddp_hook)
            x, y = (torch.from_numpy(a).to(device) for a in batch(rank, 0))
            torch.nn.functional.mse_loss(ddp(x), y).backward()
    attempt("reused", reused)
    attempt("twice", lambda: [grace.DDPState(c) for c in [grace.topk(0.05)] * 2])
    save("errors", {}, found)


def mismatch():
    """Rank 1 compresses with another ratio: every worker raises the same clear error."""
    compression = grace.topk(0.05 if rank == 0 else 0.02)
    model, ddp = linear_ddp(compression)
    x, y = (torch.from_numpy(a).to(device) for a in batch(rank, 0))
    try:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        message = None
    except Exception as error:  # what the user sees from backward()
        message = f"{type(error).__name__}: {error}"
    save("mismatch", {"w": model.weight}, {"error": message})


SCENARIOS = {
    "none": lambda: linear_scenario("none", grace.none),
    "topk": lambda: linear_scenario("topk", lambda: grace.topk(0.05)),
    # What docs/ddp.md tells a DDP user with momentum SGD: the momentum to DGC, none to SGD.
    "dgc_given": lambda: linear_scenario(
        "dgc_given", lambda: grace.dgc(0.05, sample_ratio=1.0, momentum=0.9), named=True),
    "topk_nosync": lambda: linear_scenario("topk_nosync", lambda: grace.topk(0.05), passes=2),
    "topk_nonfinite": lambda: linear_scenario("topk_nonfinite", lambda: grace.topk(0.05), poison=3),
    "topk_skip3": lambda: linear_scenario("topk_skip3", lambda: grace.topk(0.05), skip=(3,)),
    "resume": resume,
    "resume_bucket": lambda: resume("resume_bucket", lambda: grace.topk(0.05, granularity="bucket")),
    "tower_small": lambda: tower("tower_small", 0.1),
    "tower_large": lambda: tower("tower_large", 25),
    # Biases frozen, so that tiny buckets hold one weight each: DDP's buffer is then all of the
    # gradient's memory (a bias would share it).
    "tower_frozen_tiny": lambda: tower("tower_frozen_tiny", 0.001, frozen_biases=True),
    "tower_frozen_large": lambda: tower("tower_frozen_large", 25, frozen_biases=True),
    # find_unused_parameters: DDP's first buckets, never rebuilt
    "tower_unused": lambda: tower("tower_unused", 0.1, find_unused_parameters=True),
    "tower_view": lambda: tower("tower_view", 0.1, gradient_as_bucket_view=True),
    "tower_static": lambda: tower("tower_static", 0.1, static_graph=True),
    "tower_nonfinite": lambda: tower("tower_nonfinite", 0.1, poison=3),
    "tower_skip3": lambda: tower("tower_skip3", 0.1, skip=(3,)),
    "tower_dgc_small": lambda: tower("tower_dgc_small", 0.1, make=lambda: grace.dgc(momentum=0.9),
                                     named=True),
    "tower_dgc_large": lambda: tower("tower_dgc_large", 25, make=lambda: grace.dgc(momentum=0.9),
                                     named=True),
    # granularity="bucket": one residual per DDP bucket, from the buckets DDP regrouped
    "tower_bucket": lambda: tower("tower_bucket", 0.1, named=True,
                                  make=lambda: grace.topk(0.05, granularity="bucket", min_numel=0)),
    "in_place_none": lambda: in_place("in_place_none", grace.none),
    "in_place_fp16": lambda: in_place("in_place_fp16", grace.fp16),
    "errors": errors,
    "rows_none": lambda: rows("rows_none", grace.none),
    "rows_topk": lambda: rows("rows_topk", lambda: grace.topk(0.05)),
    "mismatch": mismatch,
    "topk_alltoall": lambda: linear_scenario(
        "topk_alltoall", lambda: grace.topk(0.05, communicator="alltoall")),
    "topk_hierarchical": lambda: linear_scenario(
        "topk_hierarchical", lambda: grace.topk(0.05, hierarchical=True)),
    "topk_bucket": lambda: linear_scenario("topk_bucket", lambda: grace.topk(0.05, granularity="bucket")),
}
# Every compressor of the catalogue as tests/workers/torch_train.py runs it under Horovod (the same
# options and rates), for a bit-for-bit comparison.
CATALOGUE_OPTIONS = {"dgc": {"momentum": 0.9}}
for _c in grace.available():
    SCENARIOS[f"catalogue_{_c}"] = lambda c=_c: linear_scenario(
        f"catalogue_{c}", lambda: grace.build(c, min_numel=0, **CATALOGUE_OPTIONS.get(c, {})),
        lr=CATALOGUE_LR.get(c, LR), named=True)

# Each runs where it can: hierarchical=True needs hosts (tests/test_ddp.py runs it on the emulated
# cluster); the mismatch, two workers or more.
ALL = [s for s in SCENARIOS if s != "topk_hierarchical" and (size > 1 or s != "mismatch")]
chosen = ALL if args.scenarios == "all" else args.scenarios.split(",")
for scenario in chosen:
    SCENARIOS[scenario]()
# A DDP user needs no Horovod: none was imported.
with open(os.path.join(args.outdir, f"modules.rank{rank}.json"), "w") as f:
    json.dump({"horovod": any(m.split(".")[0] == "horovod" for m in sys.modules)}, f)
dist.barrier()
dist.destroy_process_group()
