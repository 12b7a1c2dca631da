"""Side-by-side runs: framework × compression × link rate × workers × workload, each a real Horovod job
(``compare_worker.py``) on an emulated cluster (``cluster.py``: one network namespace per worker,
links shaped with tc) when run as root, or on unshaped localhost otherwise (said at the start).

Every table has the two baselines: ``fp32`` (Horovod's own uncompressed allreduce) and ``hvd-fp16``
(Horovod's own ``Compression.fp16``). Per run: samples/s, the step time split into compute,
compression and communication, payload bytes per step per worker (from grace's ``stats()``) and the
bytes that crossed the worker's link (the emulated host's ``eth0`` counters), the metric per epoch
and the training time until it reaches the workload's target. A run that fails is a row saying so.

    sudo python -m scripts.compare --workloads mnist,lstm,exchange --frameworks torch,tf \
        --compressors fp32,hvd-fp16,topk:ratio=0.01,powersgd:rank=2 --rates 100mbit,1gbit,unshaped \
        --workers 2,4 --out out/compare

Outputs under ``--out``: results.csv, results.md, results.json and PNG plots (throughput against
link rate per compressor; metric against wall time; PyTorch against TensorFlow).

``--alone`` adds, per workload and framework, the same worker on ONE emulated host's core with
Horovod's own uncompressed optimizer (no communication: the limit), and every row its samples/s per
worker against that figure (``of_alone``, the scaling efficiency). ``of_compute`` is the step's
compute (the same workers' local step, all computing at once, without Horovod's exchange) over the
step: what the exchange and compression leave of what these workers could do. ``--repeats N`` runs the whole
matrix N times, interleaved (repeat by repeat, so that a slow spell of the machine touches every
set-up alike); a row's figures are the medians over its repeats, each repeat's samples/s kept in
results.json (``repeats``).

    sudo python -m scripts.compare --workloads resnet50 --frameworks torch,tf --alone --repeats 3 \
        --compressors fp32,hvd-fp16,none,fp16,topk:ratio=0.01,dgc,powersgd:rank=2 --rates 1gbit

``--engines horovod,ddp`` sets PyTorch's DistributedDataParallel beside Horovod (framework ``ddp``:
one ``torchrun`` per emulated host, grace through ``grace.ddp_hook``): ``fp32`` is then DDP without a
hook, PyTorch's own hooks run by their names in ``torch_hooks.py`` (``torch-fp16``,
``torch-powersgd-r1``, ...; only under DDP, as ``hvd-fp16`` only under Horovod), and DDP's rows are
set against PyTorch's one worker alone.

    sudo python -m scripts.compare --workloads exchange,resnet50 --frameworks torch \
        --engines horovod,ddp --alone --compressors fp32,hvd-fp16,torch-fp16,fp16,topk:ratio=0.01
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from tqdm import tqdm

from scripts import ROOT, cluster, torch_hooks, workloads

BASELINES = ("fp32", "hvd-fp16")
ALONE = "alone"  # the rate column of the one-worker run with no communication
FRAMEWORK_NAMES = {"torch": "PyTorch", "tf": "TensorFlow", "ddp": "PyTorch DDP"}  # in the tables
METRIC = {"mnist": ("test_accuracy", "max", workloads.MNIST["target"]),
          "cnn": ("test_accuracy", "max", workloads.CNN["target"]),
          "lstm": ("perplexity", "min", workloads.LSTM["target"]),
          "words": ("perplexity", "min", workloads.WORDS["target"]),
          "exchange": (None, None, None), "resnet50": (None, None, None)}
COLUMNS = ["workload", "framework", "compression", "rate", "workers", "status", "samples_per_s",
           "of_alone", "of_compute", "repeats", "step_ms", "compute_ms", "compression_ms", "communication_ms",
           "payload_kib_per_step", "wire_kib_per_step", "metric", "final", "time_to_target_s"]


def is_named(compression: str) -> bool:
    """Whether a compression is one of the engines' own, by name (``fp32``, ``hvd-fp16``, PyTorch's
    DDP hooks), rather than grace's ``from_params`` JSON object."""
    return compression in BASELINES or compression in torch_hooks.HOOKS


def spec_parts(text: str) -> tuple[str, dict]:
    """A spec ``name:key=value;...``'s compressor name and parameters (values parsed as JSON,
    else strings), unchecked."""
    name, _, rest = text.partition(":")
    params: dict = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return name, params


def parse_compression(text: str) -> str:
    """``fp32``, ``hvd-fp16``, one of PyTorch's DDP hooks (``torch_hooks.HOOKS``: ``torch-fp16``,
    ``torch-powersgd-r1``, ...), or ``name:key=value;...`` (values parsed as JSON, else strings) to
    the worker's ``--compression`` argument; bad names and parameters fail here, before any run."""
    if text in torch_hooks.NOT_ON_GLOO:  # these runs are on CPUs, over Gloo
        raise ValueError(f"{text} does not run on Gloo: {torch_hooks.NOT_ON_GLOO[text]}")
    if is_named(text):
        return text
    name, given = spec_parts(text)
    params: dict = {"compressor": name, **given}
    import grace

    grace.from_params(params)  # raises a ValueError naming what is wrong
    return json.dumps(params)


def engine_frameworks(frameworks: str, engines: str) -> list[str]:
    """The rows' frameworks of ``--frameworks`` and ``--engines``: ``torch`` and ``tf`` through
    Horovod, ``ddp`` for PyTorch through DistributedDataParallel; a ValueError names what is wrong."""
    names, kinds = split(frameworks), split(engines)
    for fw in names:
        if fw not in ("torch", "tf"):
            raise ValueError(f"--frameworks: {fw!r} is not one of torch, tf")
    for engine in kinds:
        if engine not in ("horovod", "ddp"):
            raise ValueError(f"--engines: {engine!r} is not one of horovod, ddp")
    if "ddp" in kinds and "torch" not in names:
        raise ValueError("--engines ddp runs PyTorch: --frameworks must include torch")
    return (names if "horovod" in kinds else []) + (["ddp"] if "ddp" in kinds else [])


def runs_under(fw: str, compression: str) -> bool:
    """Whether ``compression`` belongs to framework ``fw``'s engine: Horovod's fp16 to Horovod's
    (``torch``, ``tf``), PyTorch's DDP hooks to DDP (``ddp``), grace's and ``fp32`` to each."""
    if compression == "hvd-fp16":
        return fw != "ddp"
    if compression in torch_hooks.HOOKS:
        return fw == "ddp"
    return True


def worker_command(fw: str, workload: str, compression: str, args, wire: bool,
                   extra: tuple = ()) -> list[str]:
    """The worker's command line; ``extra``: more worker arguments (``--optimizer adam``, ``--lr``)."""
    cmd = [sys.executable, "-m", "scripts.compare_worker", "--framework", fw,
           "--workload", workload, "--compression", compression, "--epochs", str(args.epochs),
           "--steps", str(args.exchange_steps if workload == "exchange" else args.steps), *extra]
    return cmd + (["--wire"] if wire else [])


def worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="")
    return env


def run_one(fw, workload, compression, rate, workers, args, emulate: bool, extra: tuple = ()) -> dict:
    """One Horovod job; its RESULT line, or a row saying why it failed. ``rate`` ``ALONE``: one
    worker on the first of two emulated hosts, so on one core as each worker of a 2-host run."""
    row = {"workload": workload, "framework": fw, "compression": compression, "rate": rate,
           "workers": workers}
    command = worker_command(fw, workload, compression, args, wire=emulate, extra=extra)
    try:
        if emulate:
            per_host = args.workers_per_host
            hosts = 2 if rate == ALONE else -(-workers // per_host)
            with cluster.EmulatedCluster(hosts, None if rate == ALONE else rate,
                                         pin=not args.no_pin) as net:
                if fw == "ddp":  # one torchrun per host, as on a real cluster
                    if workers != hosts * per_host:
                        raise ValueError(f"DDP runs fill their hosts: {workers} workers at "
                                         f"{per_host} per host")
                    code, output = net.torchrun(per_host, command[1:], env=worker_env(),
                                                timeout=args.timeout)
                    if code:
                        raise RuntimeError(_last_error(output))
                else:
                    output = _run(net.launch_args(workers, command, per_host), args.timeout)
        elif fw == "ddp":
            torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
            output = _run([torchrun, "--standalone", f"--nproc-per-node={workers}", *command[1:]],
                          args.timeout)
        else:
            horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
            output = _run([horovodrun, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo",
                           *command], args.timeout)
    except Exception as e:
        return {**row, "status": f"failed: {str(e).strip().splitlines()[-1][:160]}"}
    results = [line.split("RESULT ", 1)[1] for line in output.splitlines() if "RESULT " in line]
    if not results:
        return {**row, "status": f"failed: no result; {output.strip().splitlines()[-1][:160]}"}
    return {**row, "status": "ok", **json.loads(results[-1])}


def _run(cmd: list[str], timeout: float) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), cwd=ROOT,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(_last_error(output))
    return output


def _last_error(output: str) -> str:
    tail = [line for line in output.splitlines() if "Error" in line or "error" in line]
    return (tail or output.splitlines() or ["(no output)"])[-1]


def label(compression: str) -> str:
    if is_named(compression):
        return compression
    params = json.loads(compression)
    name = params.pop("compressor")
    return name + ("(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")


def time_to_target(row: dict) -> float | None:
    key, better, target = METRIC[row["workload"]]
    for epoch in row.get("epochs", []):
        value = epoch.get(key)
        if value is not None and (value >= target if better == "max" else value <= target):
            return epoch["train_wall_s"]
    return None


def flatten(row: dict, alone: dict | None = None) -> dict:
    """A row of the tables; ``alone``: (workload, framework) -> one worker alone's samples/s."""
    out = {c: row.get(c, "") for c in ("workload", "framework", "rate", "workers", "status")}
    out["compression"] = label(row["compression"])
    if row["status"] != "ok":
        return out
    key = METRIC[row["workload"]][0]
    last = row["epochs"][-1]
    limit = (alone or {}).get((row["workload"], row["framework"]))
    out.update(of_alone=round(row["samples_per_s"] / row["workers"] / limit, 3) if limit else "",
               of_compute=round(row["compute_s"] / row["step_s"], 3) if row["compute_s"] else "",
               repeats=len(row.get("repeats", [])) or 1)
    out.update(samples_per_s=round(row["samples_per_s"], 1), step_ms=round(row["step_s"] * 1e3, 1),
               compute_ms=round(row["compute_s"] * 1e3, 1),
               compression_ms=round(row["compression_s"] * 1e3, 1),
               communication_ms=round(row["communication_s"] * 1e3, 1),
               payload_kib_per_step=round(row["bytes_per_step"] / 1024, 1),
               wire_kib_per_step=round(row["wire_bytes_per_step"] / 1024, 1)
               if "wire_bytes_per_step" in row else "",
               metric=key or "", final=round(last[key], 4) if key else "")
    ttt = time_to_target(row) if key else None
    out["time_to_target_s"] = round(ttt, 1) if ttt is not None else ("not reached" if key else "")
    return out


def markdown(rows: list[dict]) -> str:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        key, _, target = METRIC[workload]
        lines.append(f"\n### {workload}" + (f" (target {key} {target})" if key else ""))
        cols = [c for c in COLUMNS if c not in ("workload", "metric")]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "|".join("---" if c in ("framework", "compression", "rate", "status")
                                    else "---:" for c in cols) + "|")
        for r in rows:
            if r["workload"] == workload:
                lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(lines).lstrip("\n")


def rate_order(rate: str) -> float:
    if rate == ALONE:
        return -1.0
    bits = cluster.rate_bits(rate)
    return bits if bits is not None else float("inf")


def plots(results: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limits = alone_limits(results)
    ok = [r for r in results if r["status"] == "ok" and r["rate"] != ALONE]
    frameworks = list(dict.fromkeys(r["framework"] for r in ok))
    made = []
    if limits and any((r["workload"], r["framework"]) in limits for r in ok):
        made.append(plot_of_alone(ok, limits, out, plt))
    for workload in dict.fromkeys(r["workload"] for r in ok):
        rows = [r for r in ok if r["workload"] == workload]
        # Throughput against link rate, one line per compression, per framework and worker count.
        groups = sorted({(r["framework"], r["workers"]) for r in rows})
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
        rates = sorted({r["rate"] for r in rows}, key=rate_order)
        for ax, (fw, n) in zip(axes[0], groups):
            for comp in dict.fromkeys(r["compression"] for r in rows):
                pts = {r["rate"]: r["samples_per_s"] for r in rows
                       if r["framework"] == fw and r["workers"] == n and r["compression"] == comp}
                xs = [i for i, rate in enumerate(rates) if rate in pts]
                ax.plot(xs, [pts[rates[i]] for i in xs], marker="o", label=label(comp))
            ax.set_xticks(range(len(rates)), rates)
            ax.set_yscale("log")
            ax.set_title(f"{workload}: {fw}, {n} workers")
            ax.set_xlabel("link rate per host")
            ax.set_ylabel("samples/s (log)")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, f"throughput_vs_rate_{workload}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

        key = METRIC[workload][0]
        if key:  # metric against training wall time, at the slowest rate, per framework
            slowest = rates[0]
            fig, axes = plt.subplots(1, len(frameworks), figsize=(5 * len(frameworks), 4), squeeze=False)
            for ax, fw in zip(axes[0], frameworks):
                for r in rows:
                    if r["framework"] == fw and r["rate"] == slowest:
                        ax.plot([e["train_wall_s"] for e in r["epochs"]], [e[key] for e in r["epochs"]],
                                marker="o", label=f"{label(r['compression'])}, {r['workers']}w")
                ax.set_title(f"{workload}: {fw}, {slowest}")
                ax.set_xlabel("training wall time (s)")
                ax.set_ylabel(key)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            fig.tight_layout()
            path = os.path.join(out, f"{key}_vs_time_{workload}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            made.append(path)

    if {"torch", "tf"} <= set(frameworks):  # PyTorch against TensorFlow: samples/s of the same set-ups
        fig, ax = plt.subplots(figsize=(7, 5))
        pairs = {}
        for r in ok:
            pairs.setdefault((r["workload"], r["compression"], r["rate"], r["workers"]), {})[
                r["framework"]] = r["samples_per_s"]
        for workload in dict.fromkeys(r["workload"] for r in ok):
            pts = [(v["torch"], v["tf"]) for k, v in pairs.items()
                   if k[0] == workload and "torch" in v and "tf" in v]
            if pts:
                ax.scatter(*zip(*pts), label=workload)
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("PyTorch samples/s")
        ax.set_ylabel("TensorFlow samples/s")
        ax.set_title("same workload, compression, link and workers")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out, "torch_vs_tf.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def plot_of_alone(rows: list[dict], limits: dict, out: str, plt) -> str:
    """Samples/s per worker against one worker alone, per compression: one panel per workload,
    framework and worker count, a bar per link rate (colour) with the repeats' spread as a range."""
    import numpy as np

    panels = sorted({(r["workload"], r["framework"], r["workers"]) for r in rows
                     if (r["workload"], r["framework"]) in limits})
    rates = sorted({r["rate"] for r in rows}, key=rate_order)
    comps = list(dict.fromkeys(r["compression"] for r in rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7, 0.9 * len(comps) * len(rates)),
                                                       3.2 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(rates))
    colours = plt.get_cmap("tab10")
    for ax, (workload, fw, n) in zip(axes[:, 0], panels):
        limit = limits[(workload, fw)]
        for j, rate in enumerate(rates):
            for i, comp in enumerate(comps):
                found = [r for r in rows if (r["workload"], r["framework"], r["workers"], r["rate"],
                                             r["compression"]) == (workload, fw, n, rate, comp)]
                if not found:
                    continue
                r = found[0]
                spread = np.array(r.get("repeats") or [r["samples_per_s"]]) / n / limit
                ax.bar(i + (j - (len(rates) - 1) / 2) * width, r["samples_per_s"] / n / limit, width,
                       color=colours(j), label=rate if i == 0 else None,
                       yerr=[[r["samples_per_s"] / n / limit - spread.min()],
                             [spread.max() - r["samples_per_s"] / n / limit]], capsize=2)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(comps)), [label(c) for c in comps], rotation=20, fontsize=7,
                      ha="right")
        ax.set_ylabel("of one worker alone")
        ax.set_ylim(0, 1.1)
        ax.set_title(f"{workload}: {fw}, {n} workers; one worker alone {limit:.1f} samples/s = 1")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, title="link", title_fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "of_alone.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def read_runs(paths: list[str]) -> list[dict]:
    """Every repeat of the runs in results.json files, concatenated, a later file's run of the same
    set-up and repeat replacing an earlier one's."""
    merged: dict = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f):
                key = (row["workload"], row["framework"], row["compression"], row["rate"],
                       row["workers"], row.get("optimizer", "sgd"), row.get("repeat", 0))
                merged[key] = row
    return list(merged.values())


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workloads", default="mnist,lstm,exchange")
    parser.add_argument("--frameworks", default="torch,tf")
    parser.add_argument("--engines", default="horovod",
                        help="horovod: the frameworks through Horovod; ddp: PyTorch through "
                             "DistributedDataParallel (torchrun; rows of framework 'ddp', grace by "
                             "grace.ddp_hook, PyTorch's own hooks by their names in torch_hooks.py); "
                             "horovod,ddp: side by side")
    parser.add_argument("--compressors", default="fp32,hvd-fp16,topk:ratio=0.01",
                        help="comma-separated; parameters after ':' joined by ';', e.g. "
                             "topk:ratio=0.01,qsgd:levels=15")
    parser.add_argument("--rates", default="100mbit,1gbit,unshaped")
    parser.add_argument("--workers", default="2")
    parser.add_argument("--workers-per-host", type=int, default=1,
                        help="workers on each emulated host (they share its link; default 1)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch (mnist, lstm)")
    parser.add_argument("--exchange-steps", type=int, default=4, help="steps per epoch (exchange)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave the emulated hosts' workers to the scheduler instead of each "
                             "host's own cores (scripts/cluster.py)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the workers' seed (initial weights, data order, synthetic data)")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="mnist and lstm: the workload's SGD, or Adam (lr 1e-3), whose moments "
                             "random-k takes over (its payload then carries them too)")
    parser.add_argument("--alone", action="store_true",
                        help="also run each workload and framework on one worker with Horovod's "
                             "own optimizer (no communication): the of_alone column's limit")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the matrix this many times, interleaved; figures are medians")
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "compare"))
    parser.add_argument("--from-json", nargs="+", metavar="FILE",
                        help="no runs: rebuild the tables and plots from earlier results.json files "
                             "(their runs concatenated, a later run of the same set-up replacing an "
                             "earlier one)")
    args = parser.parse_args(argv)
    if args.from_json:
        os.makedirs(args.out, exist_ok=True)
        return write_outputs(read_runs(args.from_json), args.out, time.time())

    names = split(args.workloads)
    for w in names:
        if w not in workloads.WORKLOADS:
            parser.error(f"--workloads: {w!r} is not one of {', '.join(workloads.WORKLOADS)}")
    try:
        frameworks = engine_frameworks(args.frameworks, args.engines)
    except ValueError as e:
        parser.error(str(e))
    try:
        compressions = [parse_compression(c) for c in split(args.compressors)]
        rates = split(args.rates)
        for r in rates:
            cluster.rate_bits(r)
        workers = [int(n) for n in split(args.workers)]
    except ValueError as e:
        parser.error(str(e))
    emulate, why = cluster.can_emulate()
    if not emulate:
        print(f"NOTE: no emulated cluster ({why}); every run is on localhost, unshaped.", flush=True)
        rates = ["unshaped (localhost)"]
    os.makedirs(args.out, exist_ok=True)

    # One worker alone runs Horovod's own optimizer, also for the DDP rows (alone_limits).
    alone = dict.fromkeys("torch" if fw == "ddp" else fw for fw in frameworks)
    one_pass = [(w, fw, "fp32", ALONE, 1) for w in names for fw in alone] if args.alone else []
    one_pass += [run for run in itertools.product(names, frameworks, compressions, rates, workers)
                 if runs_under(run[1], run[2])]
    matrix = [(repeat, *run) for repeat in range(args.repeats) for run in one_pass]
    results = []
    started = time.time()
    with tqdm(matrix, desc="runs", unit="run") as bar:
        for repeat, workload, fw, comp, rate, n in bar:
            bar.set_postfix_str(f"{workload} {fw} {label(comp)} {rate} {n}w #{repeat + 1}")
            extra = (("--seed", str(args.seed)) if args.seed else ()) + (
                ("--optimizer", "adam") if args.optimizer == "adam" else ())
            row = run_one(fw, workload, comp, rate if emulate else None, n, args, emulate, extra)
            row.update(rate=rate, seed=args.seed, optimizer=args.optimizer, repeat=repeat)
            results.append(row)
            flat = flatten(row)
            bar.write(f"{workload:8s} {fw:5s} {flat['compression']:28s} {row['rate']:10s} {n}w #{repeat + 1} "
                      + (f"{flat['samples_per_s']:>9} samples/s  {flat['final']}" if row["status"] == "ok"
                         else row["status"]))
    return write_outputs(results, args.out, started)


SPLIT = ("samples_per_s", "step_s", "compute_s", "compression_s", "communication_s")


def medians(results: list[dict]) -> list[dict]:
    """One row per set-up: the repeats' medians of the throughput and the step's split (the
    other fields, epochs included, from the repeat whose samples/s is the median), with every
    repeat's samples/s under ``repeats``. A set-up of failed runs keeps its first failure."""
    import numpy as np

    groups: dict = {}
    for r in results:
        key = (r["workload"], r["framework"], r["compression"], r["rate"], r["workers"],
               r.get("optimizer", "sgd"))
        groups.setdefault(key, []).append(r)
    rows = []
    for runs in groups.values():
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            rows.append(runs[0])
            continue
        ok.sort(key=lambda r: r["samples_per_s"])
        row = dict(ok[(len(ok) - 1) // 2])
        row.update({k: float(np.median([r[k] for r in ok])) for k in SPLIT})
        row["repeats"] = [r["samples_per_s"] for r in runs if r["status"] == "ok"]
        row["failed_repeats"] = len(runs) - len(ok)
        rows.append(row)
    return rows


def alone_limits(rows: list[dict]) -> dict:
    """(workload, framework) -> samples/s of one worker alone (the ``ALONE`` rows); DDP's rows
    share PyTorch's (the same model and step on one core, no communication)."""
    limits = {(r["workload"], r["framework"]): r["samples_per_s"] for r in rows
              if r["rate"] == ALONE and r["status"] == "ok"}
    for workload, fw in list(limits):
        if fw == "torch" and any(r["framework"] == "ddp" for r in rows):
            limits.setdefault((workload, "ddp"), limits[(workload, fw)])
    return limits


def end_to_end_markdown(rows: list[dict]) -> str:
    """Where one worker alone was run: per workload, link rate and worker count, a table of what
    each compression gives a worker, side by side for the frameworks (the rows of ``medians``):
    samples/s per worker, against one worker alone and against the same workers' compute, and the
    step's split. Empty without ``ALONE`` rows."""
    limits = alone_limits(rows)
    if not limits:
        return ""
    runs = [r for r in rows if r["rate"] != ALONE and (r["workload"], r["framework"]) in limits]
    frameworks = list(dict.fromkeys(r["framework"] for r in runs))
    names = FRAMEWORK_NAMES
    lines = []
    for workload, rate, n in dict.fromkeys((r["workload"], r["rate"], r["workers"]) for r in runs):
        alone = ", ".join(f"{names.get(fw, fw)} {limits[(workload, fw)]:.1f}" for fw in frameworks
                          if (workload, fw) in limits)
        lines.append(f"\n{workload}, {n} workers at {rate}; one worker alone (samples/s): {alone}.\n")
        head = ["compression"]
        for fw in frameworks:
            head += [f"{names.get(fw, fw)} per worker", "of alone", "of compute",
                     "compute ms", "compression ms", "rest ms"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---|" + "---:|" * (len(head) - 1))
        for comp in dict.fromkeys(r["compression"] for r in runs if r["workload"] == workload):
            cells = [label(comp)]
            for fw in frameworks:
                found = [r for r in runs if (r["workload"], r["rate"], r["workers"], r["compression"],
                                             r["framework"]) == (workload, rate, n, comp, fw)]
                if not found:
                    cells += [""] * 6
                    continue
                r = found[0]
                if r["status"] != "ok":
                    cells += [r["status"].split(":")[0]] + [""] * 5
                    continue
                per = r["samples_per_s"] / n
                cells += [f"{per:.1f}", f"{per / limits[(workload, fw)]:.2f}",
                          f"{r['compute_s'] / r['step_s']:.2f}", f"{r['compute_s'] * 1e3:.0f}",
                          f"{r['compression_s'] * 1e3:.0f}", f"{r['communication_s'] * 1e3:.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n") + "\n"


def step_time_markdown(rows: list[dict]) -> str:
    """Per workload, link rate and worker count without one worker alone (the exchange workload):
    each compression's step time per framework, against the same framework's ``fp32`` (how many
    times faster), and the bytes its worker's link carried per step (the rows of ``medians``)."""
    limits = alone_limits(rows)
    runs = [r for r in rows if r["rate"] != ALONE and (r["workload"], r["framework"]) not in limits]
    frameworks = list(dict.fromkeys(r["framework"] for r in runs))
    names = FRAMEWORK_NAMES
    lines = []
    for workload, rate, n in dict.fromkeys((r["workload"], r["rate"], r["workers"]) for r in runs):
        here = [r for r in runs if (r["workload"], r["rate"], r["workers"]) == (workload, rate, n)]
        fp32 = {r["framework"]: r["step_s"] for r in here if r["compression"] == "fp32"
                and r["status"] == "ok"}
        lines.append(f"\n{workload}, {n} workers at {rate}: step time, and how many times faster "
                     f"than the framework's fp32 (Horovod's allreduce, or DDP's without a hook).\n")
        head = ["compression"]
        for fw in frameworks:
            head += [f"{names.get(fw, fw)} step ms", "x fp32", "link KiB/step"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---|" + "---:|" * (len(head) - 1))
        for comp in dict.fromkeys(r["compression"] for r in here):
            cells = [label(comp)]
            for fw in frameworks:
                found = [r for r in here if (r["framework"], r["compression"]) == (fw, comp)]
                if not found:
                    cells += [""] * 3
                elif found[0]["status"] != "ok":
                    cells += [found[0]["status"].split(":")[0], "", ""]
                else:
                    r = found[0]
                    wire = r.get("wire_bytes_per_step")
                    cells += [f"{r['step_s'] * 1e3:.0f}",
                              f"{fp32[fw] / r['step_s']:.2f}" if fw in fp32 else "",
                              "" if wire is None else f"{wire / 1024:,.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n") + ("\n" if lines else "")


def _run_names(paths: Sequence[str]) -> list[str]:
    """Each run file's name in a table: its stem, or its folder and stem where two share a stem
    (``results.json`` of two runs)."""
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    return [os.path.join(os.path.basename(os.path.dirname(p)), stem) if stems.count(stem) > 1 else stem
            for p, stem in zip(paths, stems)]


def _case_words(optimizer: str) -> str:
    return "" if optimizer == "sgd" else f", {optimizer}"


def _named_rows(runs_by_file: Sequence[tuple[str, list[dict]]]) -> list[tuple[str, dict]]:
    """(the run's name, one finished set-up's medians) for every file's runs (``_run_names``)."""
    names = _run_names([path for path, _ in runs_by_file])
    return [(name, r) for name, (_, runs) in zip(names, runs_by_file) for r in medians(runs)
            if r.get("status") == "ok"]


def bytes_markdown(runs_by_file: Sequence[tuple[str, list[dict]]]) -> str:
    """Bytes on one worker's link per step (sent and received, Horovod's own traffic included)
    against the number of workers, per workload, framework and link rate: a row per compression, a
    column per worker count, and the growth from the fewest workers to the most. Each file's runs
    are its own rows (the medians of their repeats); a compression that another file ran too is
    named with its file's name, so that runs of two versions of the code stay apart."""
    rows = _named_rows(runs_by_file)
    files_of: dict = {}
    for stem, r in rows:
        files_of.setdefault(r["compression"], set()).add(stem)
    lines = []

    def case_of(r: dict) -> tuple:
        return r["workload"], r["framework"], r["rate"], r.get("optimizer", "sgd")

    for case in dict.fromkeys(case_of(r) for _, r in rows):
        here = [(stem, r) for stem, r in rows if case_of(r) == case]
        counts = sorted({r["workers"] for _, r in here})
        workload, framework, rate, optimizer = case
        lines.append(f"\n{workload}{_case_words(optimizer)}, {FRAMEWORK_NAMES.get(framework, framework)}, "
                     f"{rate}: KiB on one worker's link per step, by the number of workers.\n")
        lines.append("| compression | " + " | ".join(f"{n} workers" for n in counts)
                     + f" | {counts[-1]} / {counts[0]} |")
        lines.append("|---|" + "---:|" * (len(counts) + 1))
        for stem, comp in dict.fromkeys((stem, r["compression"]) for stem, r in here):
            wire = {r["workers"]: r.get("wire_bytes_per_step") for s, r in here
                    if (s, r["compression"]) == (stem, comp)}
            name = label(comp) + (f" ({stem})" if len(files_of[comp]) > 1 else "")
            cells = ["" if wire.get(n) is None else f"{wire[n] / 1024:,.0f}" for n in counts]
            ends = wire.get(counts[0]), wire.get(counts[-1])
            growth = f"{ends[1] / ends[0]:.2f}" if None not in ends and len(counts) > 1 else ""
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {growth} |")
    return "\n".join(lines).lstrip("\n") + ("\n" if lines else "")


def runs_markdown(runs_by_file: Sequence[tuple[str, list[dict]]]) -> str:
    """Several runs of one matrix side by side (each file a run, named by its file): per workload,
    worker count and link rate, a column per run and framework, fp32's step time in the first row
    and, below it, how many times faster than that run's fp32 each compression was (the medians
    of its repeats). Only ratios within one run are compared: runs differ by more than that."""
    rows = _named_rows(runs_by_file)
    lines = []

    def case_of(r: dict) -> tuple:
        return r["workload"], r["workers"], r["rate"], r.get("optimizer", "sgd")

    for case in dict.fromkeys(case_of(r) for _, r in rows):
        here = [(stem, r) for stem, r in rows if case_of(r) == case]
        columns = list(dict.fromkeys((stem, r["framework"]) for stem, r in here))
        step = {(stem, r["framework"], r["compression"]): r["step_s"] for stem, r in here}
        workload, workers, rate, optimizer = case
        lines.append(f"\n{workload}{_case_words(optimizer)}, {workers} workers at {rate}: fp32's step, "
                     f"and how many times faster than it each compression was in the same run.\n")
        lines.append("| compression | " + " | ".join(
            f"{FRAMEWORK_NAMES.get(fw, fw)}, {stem}" for stem, fw in columns) + " |")
        lines.append("|---|" + "---:|" * len(columns))
        fp32 = [step.get((stem, fw, "fp32")) for stem, fw in columns]
        lines.append("| fp32 step | " + " | ".join(
            "" if s is None else f"{s * 1e3:.0f} ms" for s in fp32) + " |")
        for comp in dict.fromkeys(r["compression"] for _, r in here if r["compression"] != "fp32"):
            cells = [f"{base / step[(stem, fw, comp)]:.2f}×"
                     if base is not None and (stem, fw, comp) in step else ""
                     for (stem, fw), base in zip(columns, fp32)]
            lines.append(f"| {label(comp)} | " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n") + ("\n" if lines else "")


def by_rate_markdown(rows: list[dict], workload: str) -> str:
    """One workload's set-ups against the link rate (the rows of ``medians``): a row per
    compression and worker count, a column per rate with each framework's figure side by side
    (samples/s, or the step's milliseconds for the exchange workload, which has no samples), and
    the bytes on one worker's link per step at the first rate."""
    runs = [r for r in rows if r["workload"] == workload and r["rate"] != ALONE and r["status"] == "ok"]
    if not runs:
        return ""
    rates = sorted(dict.fromkeys(r["rate"] for r in runs), key=rate_order)
    frameworks = list(dict.fromkeys(r["framework"] for r in runs))
    exchange = METRIC[workload][0] is None
    measure = "step ms" if exchange else "samples/s"
    fws = " / ".join(FRAMEWORK_NAMES.get(fw, fw) for fw in frameworks)
    lines = [f"{workload}: {measure} ({fws}) by link rate, and KiB on one worker's link per step "
             f"at {rates[0]}.", "",
             "| compression | workers | " + " | ".join(rates) + " | link KiB/step |",
             "|---|---:|" + "---:|" * (len(rates) + 1)]
    found = {(r["compression"], r["workers"], r["rate"], r["framework"]): r for r in runs}

    def cell(comp: str, n: int, rate: str, key) -> str:
        figures = [found.get((comp, n, rate, fw)) for fw in frameworks]
        return " / ".join("–" if r is None else key(r) for r in figures)

    for comp, n in dict.fromkeys((r["compression"], r["workers"]) for r in runs):
        cells = [cell(comp, n, rate, lambda r: f"{r['step_s'] * 1e3:.0f}" if exchange
                      else f"{r['samples_per_s']:.0f}") for rate in rates]
        link = cell(comp, n, rates[0], lambda r: f"{r['wire_bytes_per_step'] / 1024:,.0f}"
                    if r.get("wire_bytes_per_step") else "–")
        lines.append(f"| {label(comp)} | {n} | " + " | ".join(cells) + f" | {link} |")
    return "\n".join(lines) + "\n"


def summary_markdown(rows: list[dict]) -> str:
    """What the docs show of a run (the rows of ``medians``): the end-to-end table where one
    worker alone ran, the step-time table elsewhere."""
    return "\n".join(t for t in (end_to_end_markdown(rows), step_time_markdown(rows)) if t)


def write_outputs(results: list[dict], out: str, started: float) -> list[dict]:
    """results.csv, results.md, results.json and the plots under ``out``; the table on stdout.
    results.json keeps every repeat; the tables and plots show their medians."""
    every = results
    results = medians(results)
    limits = alone_limits(results)
    rows = [flatten(r, limits) for r in results]
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(every, f, indent=1)
    report = markdown(rows)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report + "\n")
    summary = end_to_end_markdown(results)
    if summary:
        with open(os.path.join(out, "end_to_end.md"), "w") as f:
            f.write(summary)
        report += "\n\n" + summary
    steps = step_time_markdown(results)
    if steps:
        with open(os.path.join(out, "step_times.md"), "w") as f:
            f.write(steps)
        report += "\n\n" + steps
    made = plots(results, out)
    print("\n" + report)
    print(f"\n{len(every)} runs in {time.time() - started:.0f} s; "
          f"{sum(r['status'] != 'ok' for r in every)} failed. Results: {out}/results.csv, "
          f"results.md, results.json, " + ", ".join(os.path.basename(p) for p in made))
    return results


if __name__ == "__main__":
    main()
