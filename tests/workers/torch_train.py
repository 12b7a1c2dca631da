"""Worker for tests/test_horovod_torch.py: trains the linear model of common.py under several
configurations and saves each rank's final weights and compression stats.

Run by ``horovodrun -np 2 python tests/workers/torch_train.py OUTDIR [--import-order ...]``."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from tests.workers.common import CATALOGUE_LR, LR, batch, torch_linear

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("--import-order", choices=["grace-first", "horovod-first", "no-grace"],
                    default="grace-first")
parser.add_argument("--scenarios", default="all")
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

if args.import_order == "grace-first":  # the order is what is being tested
    import grace  # noqa: I001
    import horovod.torch as hvd
else:
    import horovod.torch as hvd
    if args.import_order == "horovod-first":
        import grace
import torch  # noqa: E402

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()


def train(name, make_compression, steps=args.steps, op=None, passes=1, optimizer="sgd",
          clip=None, broadcast=False, seed=0, lr=LR, groups=None, predivide=1.0, loss_scale=1.0,
          clip_early=None):
    model = torch_linear(seed + (rank if broadcast else 0))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    kwargs = {"named_parameters": model.named_parameters(), "compression": make_compression(),
              "backward_passes_per_step": passes}
    if op is not None:
        kwargs["op"] = op
    if groups is not None:
        kwargs["groups"] = groups
    if predivide != 1.0:
        kwargs["gradient_predivide_factor"] = predivide
    opt = hvd.DistributedOptimizer(opt, **kwargs)
    info = {"class_module": type(opt).__module__,
            "grace": type(opt).__dict__.get("compression_stats") is not None, "ready_at_start": []}
    if info["grace"]:
        # How many of the model's gradients exist whenever a bucket's exchange starts.
        start = opt._start_bucket

        def recording(index):
            info["ready_at_start"].append(sum(q.grad is not None for q in model.parameters()))
            return start(index)
        opt._start_bucket = recording
    if broadcast:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            one_step(model, opt, step, passes, loss_scale, clip, clip_early)
    info["warnings"] = [str(w.message) for w in caught if "grace:" in str(w.message)]
    if info["grace"]:
        info["stats"] = opt.compression_stats()
    np.savez(os.path.join(args.outdir, f"{name}.rank{rank}.npz"),
             w=model.weight.detach().numpy(), b=model.bias.detach().numpy())
    with open(os.path.join(args.outdir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(info, f)


def one_step(model, opt, step, passes, loss_scale, clip, clip_early):
    """``clip``: clipped as Horovod documents (synchronize, clip, step); ``clip_early``: clipped
    between backward and step, while the exchange is under way (a script's mistake)."""
    opt.zero_grad()
    for micro in range(passes):
        x, y = batch(rank, step * passes + micro)
        loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
        (loss * loss_scale).backward()
    if clip_early is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_early)
        opt.step()
    elif clip is not None:
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()


def waiting(name):
    """A collective whose other worker comes 1 s late, waited for by grace's collectives and by
    Horovod's own ``synchronize``: the waiting thread's CPU seconds and the wait's wall seconds."""
    import time

    from frameworks.torch.collectives import HorovodCollectives

    group = HorovodCollectives()
    info = {}
    for way, finish in (("grace", group.synchronize), ("horovod", hvd.synchronize)):
        if rank == 1:
            time.sleep(1.0)
        cpu, wall = time.thread_time(), time.perf_counter()
        total = finish(group.allreduce_async(torch.full((4,), float(rank + 1)), f"{name}.{way}"))
        info[way] = {"cpu_s": time.thread_time() - cpu, "wall_s": time.perf_counter() - wall,
                     "total": total.tolist()}
    with open(os.path.join(args.outdir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(info, f)


def forced(name, make_compression):
    """Horovod's forced allreduce: rank 0's loss leaves out the second layer, whose gradient then
    comes from no hook on rank 0 but from every hook on rank 1 (Horovod's test_force_allreduce)."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(6, 4), torch.nn.Linear(4, 4)
    params = list(first.named_parameters(prefix="first")) + list(second.named_parameters(prefix="second"))
    initial = second.weight.detach().clone().numpy()
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                                   named_parameters=params, compression=make_compression())
    for step in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        h = first(x)
        loss = (h ** 2).sum() if rank == 0 else (second(h) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    np.savez(os.path.join(args.outdir, f"{name}.rank{rank}.npz"), initial_second=initial,
             **{n: p.detach().numpy() for n, p in params})


if args.import_order == "no-grace":
    scenarios = {"hvd_fp16": lambda: train("hvd_fp16", lambda: hvd.Compression.fp16),
                 "hvd_none": lambda: train("hvd_none", lambda: hvd.Compression.none)}
else:
    scenarios = {
        # Every tensor its own bucket: each starts as soon as its gradient is ready.
        "topk": lambda: train("topk", lambda: grace.topk(0.05, bucket_bytes=0)),
        # Both tensors travel dense: the default bucket holds them, one exchange once both are
        # ready; at granularity="bucket" top-k's one bucket joins them.
        "none_bucket": lambda: train("none_bucket", lambda: grace.none()),
        "topk_joined": lambda: train("topk_joined", lambda: grace.topk(0.05, granularity="bucket")),
        "topk_sum": lambda: train("topk_sum", lambda: grace.topk(0.05), op=hvd.Sum),
        "topk_broadcast": lambda: train("topk_broadcast",
                                        lambda: grace.topk(0.05, communicator="broadcast")),
        "randomk": lambda: train("randomk", lambda: grace.randomk(0.05, seed=3, min_kept=1)),
        "topk_allgather": lambda: train("topk_allgather", lambda: grace.topk(
            0.05, bucket_bytes=0, communicator="allgather")),
        # Shards all-to-all to their owners, re-encoded there, gathered (any number of workers).
        "topk_alltoall": lambda: train("topk_alltoall",
                                       lambda: grace.topk(0.05, communicator="alltoall")),
        # 1-bit through the owners: two means per 512 elements of each shard, the owners' two
        # passes of it (error feedback on both sides).
        "onebit_alltoall": lambda: train("onebit_alltoall", lambda: grace.onebit(
            memory="residual", communicator="alltoall")),
        # Dense within each host, top-k between hosts (launched on the emulated cluster).
        "topk_hierarchical": lambda: train("topk_hierarchical",
                                           lambda: grace.topk(0.05, hierarchical=True)),
        "fp16": lambda: train("fp16", lambda: grace.fp16()),
        "twobit": lambda: train("twobit", lambda: grace.twobit()),
        "twobit_absolute": lambda: train("twobit_absolute",
                                         lambda: grace.twobit(0.05, relative=False)),
        "none_passes2": lambda: train("none_passes2", lambda: grace.none(), passes=2),
        "topk_clip": lambda: train("topk_clip", lambda: grace.topk(0.05), clip=0.05),
        "topk_clip_early": lambda: train("topk_clip_early", lambda: grace.topk(0.05), clip_early=0.05),
        "topk_groups": lambda: train("topk_groups", lambda: grace.topk(0.05), groups=1),
        # Horovod's semantics with state in the pipeline: accumulation before a stateful
        # compressor, the vote summed, predivision where it matters (gradients beyond float16's
        # range), and groups that start together.
        "topk_passes2": lambda: train("topk_passes2", lambda: grace.topk(0.05), passes=2),
        "signsgd_sum": lambda: train("signsgd_sum", lambda: grace.signsgd(), op=hvd.Sum, lr=0.002),
        "fp16_predivide": lambda: train("fp16_predivide", lambda: grace.fp16(), predivide=1000.0,
                                        loss_scale=1e5, lr=LR * 1e-5),
        "fp16_not_predivided": lambda: train("fp16_not_predivided", lambda: grace.fp16(),
                                             loss_scale=1e5, lr=LR * 1e-5),
        "none_adam_broadcast": lambda: train("none_adam_broadcast", lambda: grace.none(),
                                             optimizer="adam", broadcast=True),
        "hvd_fp16": lambda: train("hvd_fp16", lambda: hvd.Compression.fp16),
        "hvd_none": lambda: train("hvd_none", lambda: hvd.Compression.none),
        "waiting": lambda: waiting("waiting"),
        # Compressions whose bucket starts with a vote (threshold, INCEPTIONN) or a host's sum.
        "forced_threshold": lambda: forced("forced_threshold", lambda: grace.threshold(min_numel=0)),
        "forced_inceptionn": lambda: forced("forced_inceptionn", lambda: grace.inceptionn(min_numel=0)),
    }
    # Every compressor of the catalogue, with its defaults (sign methods move each weight by the
    # learning rate itself, so they take a smaller one).
    # DGC's momentum given: over this plain SGD the wrapper would apply none (the optimizer as it
    # is), and TensorFlow's catalogue runs through the tape, which sees no optimizer and applies
    # DGC's own 0.9; both then run the same algorithm, masking included.
    catalogue_options = {"dgc": {"momentum": 0.9}}
    for compressor in grace.available():
        scenarios[f"catalogue_{compressor}"] = (
            lambda c=compressor: train(
                f"catalogue_{c}", lambda: grace.build(c, min_numel=0, **catalogue_options.get(c, {})),
                lr=CATALOGUE_LR.get(c, LR)))
chosen = list(scenarios) if args.scenarios == "all" else args.scenarios.split(",")
for name in chosen:
    scenarios[name]()
