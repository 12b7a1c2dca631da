"""grace's DDP communication hook against DDP's own allreduce and PyTorch's hooks, on ResNet-50's
real forward and backward, in one run: images per second of each hook, as a fraction of DDP without
a hook, the hooks interleaved round by round and the median of the rounds taken (the machine is
noisy).

On one worker (the default) the exchange moves nothing, so this measures what each hook costs on
the worker's own device: compression, decompression, error feedback and the Python around them. On
a GPU that is what stands between a compressor and the no-communication limit. With ``--hosts N``
(as root) the same runs on N emulated hosts of ``scripts/cluster.py``, one worker each, over links
of ``--rate``, and each hook's img/s per worker is also given against one worker alone.

    python -m scripts.tools.bench_ddp_hooks --device cuda --json out/hooks.json --plot out/hooks.png
    python -m scripts.tools.bench_ddp_hooks --device cpu --image 64 --batch 16    # a CPU core
    sudo .venv/bin/python -m scripts.tools.bench_ddp_hooks --device cpu --image 64 --batch 16 \
        --hosts 2 --rate 1gbit                       # 2 emulated hosts, against one worker alone

PyTorch's hooks run as their documentation recommends (``torch_hooks.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import grace
from scripts import (
    ROOT,
    torch_hooks,
)
from scripts.resnet import ResNet50

# name -> (hook, a function making its state); None: DDP's own allreduce.
HOOKS = {
    "ddp": None,
    **{name: (lambda name=name: torch_hooks.make(name)) for name in
       ("torch-fp16", "torch-powersgd-r1", "torch-powersgd-r2", "torch-batched-powersgd-r2")},
    "grace-none": lambda: (grace.ddp_hook, grace.none()),
    "grace-fp16": lambda: (grace.ddp_hook, grace.fp16()),
    "grace-powersgd-r1": lambda: (grace.ddp_hook, grace.powersgd(rank=1)),
    "grace-powersgd-r2": lambda: (grace.ddp_hook, grace.powersgd(rank=2)),
    "grace-topk": lambda: (grace.ddp_hook, grace.topk(0.01)),
    "grace-qsgd": lambda: (grace.ddp_hook, grace.qsgd()),
}


def run(args) -> dict:
    device = torch.device(args.device)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:  # started by torchrun (--hosts): its rendezvous
        dist.init_process_group(backend)
    else:
        store = tempfile.mktemp(prefix="grace-hooks-")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    workers = dist.get_world_size()
    torch.manual_seed(0)
    images = torch.randn(args.batch, 3, args.image, args.image, device=device)
    labels = torch.randint(0, 1000, (args.batch,), device=device)
    names = args.hooks.split(",")
    unknown = sorted(set(names) - set(HOOKS))
    if unknown:
        raise SystemExit(f"--hooks: unknown {unknown}; known: {', '.join(HOOKS)}")
    models = {}
    for name in names:  # each hook its own model, optimizer and state, built once
        model = ResNet50().to(device)
        ddp = DDP(model, device_ids=[device.index or 0] if args.device == "cuda" else None)
        if HOOKS[name] is not None:
            hook, state = HOOKS[name]()
            ddp.register_comm_hook(state, hook)
        models[name] = (ddp, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def steps(name, count):
        ddp, opt = models[name]
        for _ in range(count):
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(ddp(images), labels).backward()
            opt.step()

    failed = {}
    for name in list(names):
        try:
            steps(name, args.warmup)
        except Exception as error:  # a hook that fails is reported, not timed
            failed[name] = f"{type(error).__name__}: {error}".strip()
            names.remove(name)
            print(f"{name} failed: {failed[name]}", file=sys.stderr)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr, disable=dist.get_rank() > 0):
        for name in names:
            sync()
            start = time.perf_counter()
            steps(name, args.steps)
            sync()
            rates[name].append(args.steps * args.batch / (time.perf_counter() - start))
    dist.destroy_process_group()
    medians = {name: statistics.median(r) for name, r in rates.items()}
    base = medians.get("ddp")
    rows = [{"hook": name, "img_s": medians[name], "of_ddp": medians[name] / base if base else None,
             "rounds": rates[name]} for name in names]
    label = (torch.cuda.get_device_name(device) if args.device == "cuda"
             else f"CPU, {args.threads} thread(s)")
    return {"device": label, "image": args.image, "batch": args.batch, "steps": args.steps,
            "rounds": args.rounds, "torch": torch.__version__, "rows": rows, "failed": failed,
            "workers": workers, "rate": os.environ.get("GRACE_LINK_RATE"),
            "alone": None}


def _command(args, hooks: str, out: str) -> list[str]:
    return [os.path.abspath(__file__), "--device", "cpu", "--hooks", hooks, "--image",
            str(args.image), "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--rounds", str(args.rounds), "--threads", str(args.threads),
            "--worker-out", out]


def on_cluster(args) -> dict:
    """Every hook on ``args.hosts`` emulated hosts, one worker each, one torchrun per host, between
    two runs of one worker alone (DDP without a hook, no communication) on host 0's cores: the
    alone figure is the median of both runs' rounds, and each run's median is kept, to show the
    drift over the measurement."""
    import subprocess

    from scripts import cluster

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(args.threads),
               GRACE_LINK_RATE=args.rate)
    cores = ",".join(map(str, cluster.host_cpus(0, args.hosts)))
    alone = []
    with tempfile.TemporaryDirectory(prefix="grace-hooks-") as tmp:
        out = os.path.join(tmp, "hosts.json")

        def one_alone(k):
            path = os.path.join(tmp, f"alone{k}.json")
            subprocess.run(["taskset", "-c", cores, sys.executable,
                            *_command(args, "ddp", path)], env=env, check=True)
            with open(path) as f:
                alone.append(json.load(f)["rows"][0])
        one_alone(0)
        with cluster.EmulatedCluster(args.hosts, args.rate) as hosts:
            code, output = hosts.torchrun(1, _command(args, args.hooks, out), env=env)
        if code:
            raise SystemExit(f"the workers failed:\n{output[-6000:]}")
        one_alone(1)
        with open(out) as f:
            result = json.load(f)
    result["alone"] = statistics.median(r for run in alone for r in run["rounds"])
    result["alone_runs"] = [run["img_s"] for run in alone]
    return result


def markdown(result: dict) -> str:
    workers = result.get("workers", 1)
    where = ("one worker" if workers == 1 else
             f"{workers} workers on {workers} emulated hosts, links {result.get('rate')}")
    alone = result.get("alone")
    runs = result.get("alone_runs")
    before_after = ("" if not runs else f"; one worker alone {alone:.1f} img/s, the median of runs "
                    f"before and after ({runs[0]:.1f} and {runs[1]:.1f})")
    lines = [f"ResNet-50, {result['device']}, batch {result['batch']} of {result['image']}x"
             f"{result['image']}, {where}, median of {result['rounds']} interleaved rounds of "
             f"{result['steps']} steps (torch {result['torch']}){before_after}", "",
             "| hook | img/s per worker | of DDP without a hook |"
             + (" of one worker alone |" if alone else ""),
             "|---|---:|---:|" + ("---:|" if alone else "")]
    for row in result["rows"]:
        share = "" if row["of_ddp"] is None else f"{row['of_ddp']:.3f}"
        extra = f" {row['img_s'] / alone:.3f} |" if alone else ""
        lines.append(f"| {row['hook']} | {row['img_s']:.1f} | {share} |{extra}")
    for name, error in result["failed"].items():
        lines.append(f"| {name} | failed: {error[:120]} | |")
    return "\n".join(lines)


def comparison(before: dict, after: dict) -> str:
    """Two runs of the same hooks in one lease (before and after a change): each hook's img/s over
    DDP's without a hook, in each."""
    shares = [{r["hook"]: r["of_ddp"] for r in run["rows"]} for run in (before, after)]
    lines = [f"ResNet-50, {after['device']}, batch {after['batch']} of {after['image']}x"
             f"{after['image']}, one worker, two runs on one machine, median of {after['rounds']} "
             f"interleaved rounds of {after['steps']} steps each", "",
             "| hook | before: of DDP without a hook | after |", "|---|---:|---:|"]
    for hook, share in shares[1].items():
        if hook in shares[0]:
            lines.append(f"| {hook} | {shares[0][hook]:.3f} | {share:.3f} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """One bar per hook: img/s against DDP without a hook (one worker: the hook's own cost), or,
    on several hosts, per worker against one worker alone."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    alone = result.get("alone")
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    colours = ["#777777" if r["hook"] == "ddp" else "#d95f02" if r["hook"].startswith("torch")
               else "#1b9e77" for r in rows]
    shares = [r["img_s"] / alone if alone else (r["of_ddp"] or 0.0) for r in rows]
    ax.barh(range(len(rows)), shares, color=colours)
    for i, share in enumerate(shares):
        ax.text(share + 0.005, i, f"{share:.3f}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["hook"] for r in rows])
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    if alone:
        ax.set_xlabel("img/s per worker as a fraction of one worker alone (no communication)")
        where = f"{result['workers']} emulated hosts at {result['rate']}, {result['device']}"
    else:
        ax.set_xlabel("img/s as a fraction of DDP without a hook (one worker: the hook's own cost)")
        where = result["device"]
    ax.set_title(f"ResNet-50, {where}\nDDP (grey), PyTorch's hooks (orange), grace's (green)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--hooks", help="default: every hook (on the CPU, PyTorch's PowerSGD hooks "
                        "left out: on Gloo they wait on a collective inside a callback that holds "
                        "one of Gloo's threads, and hang)")
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (--device cpu)")
    parser.add_argument("--json", help="write the figures (every round) to this file")
    parser.add_argument("--plot", help="bar chart of img/s over DDP's, PNG")
    parser.add_argument("--from-json", help="print the table of an earlier run's --json file")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="print two earlier runs' --json files side by side")
    parser.add_argument("--hosts", type=int, default=0,
                        help="run on this many emulated hosts (scripts/cluster.py, as root), one "
                        "worker each, after one worker alone")
    parser.add_argument("--rate", default="1gbit", help="the emulated links' rate (--hosts)")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as f:
                runs.append(json.load(f))
        print(comparison(*runs))
        return
    if args.from_json:
        with open(args.from_json) as f:
            earlier = json.load(f)
        print(markdown(earlier))
        if args.plot:
            plot(earlier, args.plot)
        return
    if args.hooks is None:
        args.hooks = ",".join(h for h in HOOKS if args.device == "cuda" or "powersgd" not in h
                              or h.startswith("grace"))
    if args.worker_out:  # a worker of a --hosts run, started by torchrun on its emulated host
        rank = int(os.environ.get("RANK", "0"))
        result = run(args)
        if rank == 0:
            with open(args.worker_out, "w") as f:
                json.dump(result, f)
        return
    result = on_cluster(args) if args.hosts else run(args)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
