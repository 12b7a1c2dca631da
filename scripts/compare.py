"""Side-by-side runs: framework × compression × link rate × workers × workload, each a real Horovod job
(``compare_worker.py``) on an emulated cluster (``cluster.py``: one network namespace per worker,
links shaped with tc) when run as root, or on unshaped localhost otherwise (said at the start).

Every table has the two baselines: ``fp32`` (Horovod's own uncompressed allreduce) and ``hvd-fp16``
(Horovod's own ``Compression.fp16``). Per run: samples/s, the step time split into compute,
compression and communication, payload bytes per step per worker (from grace's ``stats()``) and the
bytes that crossed the worker's link (the emulated host's ``eth0`` counters), the metric per epoch
and the training time until it reaches the workload's target. A run that fails is a row saying so.

    sudo python scripts/compare.py --workloads mnist,lstm,exchange --frameworks torch,tf \
        --compressors fp32,hvd-fp16,topk:ratio=0.01,powersgd:rank=2 --rates 100mbit,1gbit,unshaped \
        --workers 2,4 --out out/compare

Outputs under ``--out``: results.csv, results.md, results.json and PNG plots (throughput against
link rate per compressor; metric against wall time; PyTorch against TensorFlow).
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

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster  # noqa: E402
import workloads  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINES = ("fp32", "hvd-fp16")
METRIC = {"mnist": ("test_accuracy", "max", workloads.MNIST["target"]),
          "lstm": ("perplexity", "min", workloads.LSTM["target"]),
          "words": ("perplexity", "min", workloads.WORDS["target"]),
          "exchange": (None, None, None)}
COLUMNS = ["workload", "framework", "compression", "rate", "workers", "status", "samples_per_s",
           "step_ms", "compute_ms", "compression_ms", "communication_ms", "payload_kib_per_step",
           "wire_kib_per_step", "metric", "final", "time_to_target_s"]


def parse_compression(text: str) -> str:
    """``fp32``, ``hvd-fp16``, or ``name:key=value,...`` (values parsed as JSON, else strings) to
    the worker's ``--compression`` argument; bad names and parameters fail here, before any run."""
    if text in BASELINES:
        return text
    name, _, rest = text.partition(":")
    params: dict = {"compressor": name}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    import grace

    grace.from_params(params)  # raises a ValueError naming what is wrong
    return json.dumps(params)


def worker_command(fw: str, workload: str, compression: str, args, wire: bool,
                   extra: tuple = ()) -> list[str]:
    """The worker's command line; ``extra``: more worker arguments (``--optimizer adam``, ``--lr``)."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "compare_worker.py"), "--framework", fw,
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
    """One Horovod job; its RESULT line, or a row saying why it failed."""
    row = {"workload": workload, "framework": fw, "compression": compression, "rate": rate,
           "workers": workers}
    command = worker_command(fw, workload, compression, args, wire=emulate, extra=extra)
    try:
        if emulate:
            per_host = args.workers_per_host
            with cluster.EmulatedCluster(-(-workers // per_host), rate, pin=not args.no_pin) as net:
                output = _run(net.launch_args(workers, command, per_host), args.timeout)
        else:
            horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
            output = _run([horovodrun, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo",
                           *command], args.timeout)
    except Exception as e:  # noqa: BLE001 (every failure becomes a row, with its reason)
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
        tail = [line for line in output.splitlines() if "Error" in line or "error" in line]
        raise RuntimeError((tail or output.splitlines() or ["(no output)"])[-1])
    return output


def label(compression: str) -> str:
    if compression in BASELINES:
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


def flatten(row: dict) -> dict:
    out = {c: row.get(c, "") for c in ("workload", "framework", "rate", "workers", "status")}
    out["compression"] = label(row["compression"])
    if row["status"] != "ok":
        return out
    key = METRIC[row["workload"]][0]
    last = row["epochs"][-1]
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
    bits = cluster.rate_bits(rate)
    return bits if bits is not None else float("inf")


def plots(results: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r["status"] == "ok"]
    frameworks = list(dict.fromkeys(r["framework"] for r in ok))
    made = []
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

    if len(frameworks) > 1:  # PyTorch against TensorFlow: samples/s of the same set-ups
        fig, ax = plt.subplots(figsize=(7, 5))
        pairs = {}
        for r in ok:
            pairs.setdefault((r["workload"], r["compression"], r["rate"], r["workers"]), {})[
                r["framework"]] = r["samples_per_s"]
        for workload in dict.fromkeys(r["workload"] for r in ok):
            pts = [(v["torch"], v["tf"]) for k, v in pairs.items() if k[0] == workload and len(v) == 2]
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


def split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workloads", default="mnist,lstm,exchange")
    parser.add_argument("--frameworks", default="torch,tf")
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
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "compare"))
    parser.add_argument("--from-json", nargs="+", metavar="FILE",
                        help="no runs: rebuild the tables and plots from earlier results.json files "
                             "(their runs concatenated, a later run of the same set-up replacing an "
                             "earlier one)")
    args = parser.parse_args(argv)
    if args.from_json:
        merged: dict = {}
        for path in args.from_json:
            with open(path) as f:
                for row in json.load(f):
                    key = (row["workload"], row["framework"], row["compression"], row["rate"],
                           row["workers"], row.get("optimizer", "sgd"))
                    merged[key] = row
        os.makedirs(args.out, exist_ok=True)
        return write_outputs(list(merged.values()), args.out, time.time())

    names = split(args.workloads)
    for w in names:
        if w not in workloads.WORKLOADS:
            parser.error(f"--workloads: {w!r} is not one of {', '.join(workloads.WORKLOADS)}")
    frameworks = split(args.frameworks)
    for fw in frameworks:
        if fw not in ("torch", "tf"):
            parser.error(f"--frameworks: {fw!r} is not one of torch, tf")
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

    matrix = list(itertools.product(names, frameworks, compressions, rates, workers))
    results = []
    started = time.time()
    with tqdm(matrix, desc="runs", unit="run") as bar:
        for workload, fw, comp, rate, n in bar:
            bar.set_postfix_str(f"{workload} {fw} {label(comp)} {rate} {n}w")
            extra = (("--seed", str(args.seed)) if args.seed else ()) + (
                ("--optimizer", "adam") if args.optimizer == "adam" else ())
            row = run_one(fw, workload, comp, rate if emulate else None, n, args, emulate, extra)
            row.update(rate=rate, seed=args.seed, optimizer=args.optimizer)
            results.append(row)
            flat = flatten(row)
            bar.write(f"{workload:8s} {fw:5s} {flat['compression']:28s} {rate:10s} {n}w  "
                      + (f"{flat['samples_per_s']:>9} samples/s  {flat['final']}" if row["status"] == "ok"
                         else row["status"]))
    return write_outputs(results, args.out, started)


def write_outputs(results: list[dict], out: str, started: float) -> list[dict]:
    """results.csv, results.md, results.json and the plots under ``out``; the table on stdout."""
    rows = [flatten(r) for r in results]
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    report = markdown(rows)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report + "\n")
    made = plots(results, out)
    print("\n" + report)
    print(f"\n{len(results)} runs in {time.time() - started:.0f} s; "
          f"{sum(r['status'] != 'ok' for r in results)} failed. Results: {out}/results.csv, "
          f"results.md, results.json, " + ", ".join(os.path.basename(p) for p in made))
    return results


if __name__ == "__main__":
    main()
