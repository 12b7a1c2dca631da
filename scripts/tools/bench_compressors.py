"""What compression costs next to a plain copy: for each compressor, framework and device, the median
over ``--repeats`` of compress time, decompress time and a plain copy of the same tensors (measured in
the same run, on the same device), the ratio (compress + decompress) / copy, the payload bytes and the
compression ratio; on one flat tensor of ``--numel`` float32 elements and on ResNet-50's gradient
shapes (``--model resnet50``). Tensors a pipeline would leave dense (too small, or not a matrix for
PowerSGD) are left out of both sides.

PyTorch runs eagerly (as in training); TensorFlow runs compress and decompress in one
``tf.function`` (compress alone in another, to split the time).

Two side-by-side extras:

- ``--powersgd``: grace's PowerSGD (rank 2), one compress + decompress round with error feedback,
  against PyTorch's own ``powerSGD_hook`` and ``batched_powerSGD_hook`` on the same ResNet-50
  matrices; grace through a group of one worker, the hooks through a single-process Gloo group (no
  network on either side).
- ``--overhead``: 2 Horovod workers time a training step with ``grace.none()`` against Horovod's own
  ``DistributedOptimizer``, interleaved in one job.

Output: a markdown table on stdout; ``--json FILE``, ``--plot FILE.png``.

    python -m scripts.tools.bench_compressors                       # every compressor, torch and tf
    python -m scripts.tools.bench_compressors --compressors topk,qsgd --frameworks torch --numel 1000000

Two checkouts side by side (did a change to the code around the algorithms make compression
slower?): ``--before DIR`` runs the catalogue through the checkout at ``DIR`` and through this one
(or ``--after DIR``), each in a process of its own importing that checkout's grace, interleaved,
``--sides`` times each; the table gives each side's median (compress + decompress) and the ratio
after / before with the range of the repeats' ratios (``sides_markdown``). Time nothing else
meanwhile.

    git worktree add /tmp/before <commit>
    python -m scripts.tools.bench_compressors --before /tmp/before --model none --repeats 5 \\
        --warmup 3 --json data/performance/bench-sides.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

import grace
from grace.compressor import Context
from grace.ops import ops_for
from scripts import (
    ROOT,
    workloads,
)
from scripts.tools.checkout_sides import assert_imported_from, take_turns

TARGET_2 = ("topk", "randomk", "signsgd", "onebit", "terngrad", "qsgd")


def interleaved_medians(fns: dict, repeats: int, warmup: int, sync=lambda: None,
                        desc: str | None = None) -> dict[str, float]:
    """The median seconds of each of ``fns`` over ``repeats`` rounds that call them in turn, after
    ``warmup`` untimed rounds. Taking turns lets every function see the same state of the machine.
    The warm-up rounds matter here: the first rounds over a new working set stall for 100-300 ms
    while the machine maps fresh memory (see docs/performance.md), and a few such rounds out of nine
    move a median; the figures are meant for the steady state of a training run. ``desc``: show
    the rounds with tqdm under that label."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds = range(warmup + repeats)
    for round_ in (tqdm(rounds, desc=desc, unit="round") if desc else rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def target(name: str) -> int:
    return 2 if name in TARGET_2 else 3


# --- the catalogue ------------------------------------------------------------------------------
def vote(comp, tensor, ops):
    """The cost the pipeline adds before encoding, for a compressor that agrees on its form
    (threshold, INCEPTIONN): its vote, 1 for dense (returned, so that a traced graph keeps it);
    ``None`` for the others."""
    if comp.agrees_on_form:
        ctx = Context(ops.shape(tensor), ops.dtype(tensor), ops.numel(tensor))
        return comp.not_smaller(ops.flatten(tensor), ctx, ops)
    return None


def sent_dense(comp, tensor, ops) -> bool:
    """Whether the pipeline sends ``tensor`` dense at this step although it compresses it: the vote,
    here of a group of one."""
    local = vote(comp, tensor, ops)
    return local is not None and float(ops.to_numpy(local)[0]) > 0


def torch_case(name, tensors, repeats, device, warmup=0):
    import torch

    pipeline = grace.build(name)
    comp = pipeline.compressor
    ops = ops_for(tensors[0])
    kept = [t for t in tensors if pipeline.compresses(tuple(t.shape), ops.dtype(t), ops)]
    if not kept:
        return None
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dense = [sent_dense(comp, t, ops) for t in kept]
    state = {}

    def compress():  # a tensor voted dense costs its vote only: it goes to the dense allreduce
        for t in kept:
            vote(comp, t, ops)
        state["out"] = [comp.compress(t, f"t{i}", ops) for i, t in enumerate(kept) if not dense[i]]

    def decompress():
        for payload, ctx in state["out"]:
            comp.decompress(payload, ctx, ops)

    def copy():
        for t in kept:
            t.clone()

    targets = [torch.empty_like(t) for t in kept]

    def copy_into():
        for t, out in zip(kept, targets):
            out.copy_(t)

    result = interleaved_medians({"copy_s": copy, "warm_copy_s": copy_into, "compress_s": compress,
                                  "decompress_s": decompress}, repeats, max(warmup, 1), sync)
    payload = (sum(ops.nbytes(p) for out, _ in state["out"] for p in out)
               + sum(ops.nbytes(t) for t, d in zip(kept, dense) if d))
    return {**result, "payload_bytes": payload, "dense_bytes": sum(ops.nbytes(t) for t in kept),
            "tensors": len(kept)}


def tf_case(name, arrays, repeats, warmup=0):
    import tensorflow as tf

    pipeline = grace.build(name)
    comp = pipeline.compressor
    tensors = [tf.constant(a) for a in arrays]
    ops = ops_for(tensors[0])
    kept = [t for t in tensors if pipeline.compresses(tuple(t.shape), "float32", ops)]
    if not kept:
        return None

    dense = [sent_dense(comp, t, ops) for t in kept]

    def encode(xs):  # as torch_case: a tensor voted dense costs its vote only
        votes = [v for v in (vote(comp, t, ops) for t in xs) if v is not None]
        return [comp.compress(t, f"t{i}", ops) for i, t in enumerate(xs) if not dense[i]], votes

    @tf.function
    def compress(xs):
        outs, votes = encode(xs)
        return [payload for payload, _ in outs], votes

    @tf.function
    def round_trip(xs):
        outs, votes = encode(xs)
        return [comp.decompress(p, ctx, ops) for p, ctx in outs], votes

    @tf.function
    def copy(xs):
        return [tf.raw_ops.DeepCopy(x=t) for t in xs]

    payloads = compress(kept)[0]
    # The round trip is timed beside the copy, and compress alone afterwards: taking turns with it
    # would compress twice per round, and a stateful compressor (signum's momentum) would then
    # write one more fresh full-size buffer per round than PyTorch's side does.
    medians = interleaved_medians({"copy": lambda: copy(kept), "round_trip": lambda: round_trip(kept)},
                                  repeats, max(warmup, 1))
    copy_s, total_s = medians["copy"], medians["round_trip"]
    # compress + decompress is the round trip's own median; compress alone only splits it.
    alone = interleaved_medians({"compress": lambda: compress(kept)}, repeats, 1)["compress"]
    compress_s = min(total_s, alone)
    payload = (sum(int(tf.size(p)) * p.dtype.size for out in payloads for p in out)
               + sum(int(tf.size(t)) * 4 for t, d in zip(kept, dense) if d))
    return {"copy_s": copy_s, "compress_s": compress_s, "decompress_s": total_s - compress_s,
            "payload_bytes": payload, "dense_bytes": sum(int(tf.size(t)) * 4 for t in kept),
            "tensors": len(kept)}


def cases(numel: int, model: str | None) -> dict[str, list[tuple[int, ...]]]:
    out = {f"flat {numel:,}": [(numel,)]}
    if model == "resnet50":
        out["resnet50"] = [s for _, s in workloads.resnet50_shapes()]
    return out


def bench_catalogue(args) -> list[dict]:
    rows = []
    devices = ["cpu"]
    frameworks = args.frameworks
    if "torch" in frameworks:
        import torch

        if torch.cuda.is_available():
            devices.append("cuda")
    rng = np.random.default_rng(0)
    shapes = cases(args.numel, args.model)
    arrays = {case: [rng.standard_normal(s, dtype=np.float32) for s in ss] for case, ss in shapes.items()}
    if args.devices:
        devices = [d for d in devices if d in args.devices.split(",")]
    jobs = [(fw, dev, case, name) for fw in frameworks
            for dev in (devices if fw == "torch" else [d for d in devices if d == "cpu"])
            for case in shapes for name in args.compressors]
    for fw, dev, case, name in tqdm(jobs, desc="compressors", unit="case"):
        try:
            if fw == "torch":
                import torch

                tensors = [torch.from_numpy(a).to(dev) for a in arrays[case]]
                result = torch_case(name, tensors, args.repeats, dev, args.warmup)
            else:
                result = tf_case(name, arrays[case], args.repeats, args.warmup)
        except Exception as e:
            lines = str(e).strip().splitlines() or [""]
            result = {"error": f"{type(e).__name__}: {lines[-1]}"[:160]}
        if result is None:
            continue
        row = {"framework": fw, "device": dev, "case": case, "compressor": name, **result}
        if "error" not in row:
            row["ratio_to_copy"] = (row["compress_s"] + row["decompress_s"]) / row["copy_s"]
            row["compression_ratio"] = row["dense_bytes"] / row["payload_bytes"]
            row["target"] = target(name)
        rows.append(row)
    return rows


def catalogue_table(rows: list[dict]) -> str:
    lines = ["| framework | device | case | compressor | compress ms | decompress ms | copy ms | "
             "(c + d) / copy | target | copy into ms | (c + d) / copy into | payload MiB | compression |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['framework']} | {r['device']} | {r['case']} | {r['compressor']} | "
                         f"{r['error']} | | | | | | | | |")
            continue
        mark = "" if r["ratio_to_copy"] <= r["target"] else " ✗"
        warm = r.get("warm_copy_s")
        warm_cells = (f"{warm * 1e3:.1f} | {(r['compress_s'] + r['decompress_s']) / warm:.1f}"
                      if warm else "– | –")
        lines.append(f"| {r['framework']} | {r['device']} | {r['case']} | {r['compressor']} | "
                     f"{r['compress_s'] * 1e3:.1f} | {r['decompress_s'] * 1e3:.1f} | "
                     f"{r['copy_s'] * 1e3:.1f} | {r['ratio_to_copy']:.2f}{mark} | ≤ {r['target']} | "
                     f"{warm_cells} | {r['payload_bytes'] / 2**20:.2f} | {r['compression_ratio']:.1f}× |")
    return "\n".join(lines)


def case_markdown(rows: list[dict], case: str, framework: str = "torch") -> str:
    """One case of the catalogue in one framework, the cheapest first: compress + decompress
    against one copy of the same tensors (``copy_s``, here of many tensors into memory the
    allocator already touched) and the compressor's target for that ratio, ✗ where it is missed."""
    found = sorted((r for r in rows if r["case"] == case and r["framework"] == framework
                    and "error" not in r), key=lambda r: r["ratio_to_copy"])
    lines = ["| compressor | (c + d) ms | copy ms | (c + d) / copy | target |",
             "|---|---:|---:|---:|---:|"]
    for r in found:
        mark = "" if r["ratio_to_copy"] <= r["target"] else " ✗"
        lines.append(f"| {r['compressor']} | {(r['compress_s'] + r['decompress_s']) * 1e3:.1f} | "
                     f"{r['copy_s'] * 1e3:.1f} | {r['ratio_to_copy']:.1f}{mark} | ≤ {r['target']} |")
    return "\n".join(lines)


def tf_vs_torch(rows: list[dict]) -> str:
    by = {(r["case"], r["compressor"], r["framework"]): r for r in rows
          if "error" not in r and r["device"] == "cpu"}
    lines = ["| case | compressor | torch (c + d) ms | tf (c + d) ms | tf / torch |",
             "|---|---|---:|---:|---:|"]
    for (case, name, fw), r in by.items():
        other = by.get((case, name, "tf"))
        if fw != "torch" or other is None:
            continue
        t = r["compress_s"] + r["decompress_s"]
        f = other["compress_s"] + other["decompress_s"]
        lines.append(f"| {case} | {name} | {t * 1e3:.1f} | {f * 1e3:.1f} | {f / t:.2f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


# --- PowerSGD against PyTorch's hooks -----------------------------------------------------------
class _Bucket:
    """What PyTorch's PowerSGD hooks read of a DDP gradient bucket: one flat buffer and per-parameter
    views of it (GradBucket has no Python constructor)."""

    def __init__(self, buffer, shapes):
        self._buffer, self._grads, offset = buffer, [], 0
        for s in shapes:
            n = int(np.prod(s))
            self._grads.append(buffer[offset:offset + n].view(s))
            offset += n

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def index(self):
        return 0

    def is_last(self):
        return True


class _Solo:
    """The collectives of a group of one worker, as cheap as PyTorch's single-process Gloo group
    is for the hook: an allreduce or broadcast returns the tensor, an allgather its flat view."""

    size, rank = 1, 0

    def allreduce_async(self, tensor, name):
        return tensor

    def broadcast_async(self, tensor, root, name):
        return tensor

    def allgather_async(self, tensor, name):
        return tensor.reshape(-1)

    def synchronize(self, handle):
        return handle


def bench_powersgd(args) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hooks

    shapes = [s for _, s in workloads.resnet50_shapes()]
    torch.manual_seed(0)
    grads = [torch.randn(s) for s in shapes]
    flat = torch.cat([g.reshape(-1) for g in grads])
    store = tempfile.mktemp(prefix="grace-gloo-")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    rows = []

    def torch_hook(hook):
        state = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                    start_powerSGD_iter=2, min_compression_rate=1,
                                    use_error_feedback=True, warm_start=True)
        state.iter = 2  # past the vanilla-allreduce warm-up
        # The hook overwrites its bucket: each round starts from the gradients again, copied into
        # the same buffer (a warm copy, a few ms, is all the harness adds to the hook's time).
        buffer = flat.clone()

        def once():
            buffer.copy_(flat)
            hook(state, _Bucket(buffer, shapes)).wait()
        return once

    pipeline = grace.powersgd(rank=2, min_numel=0)
    group = _Solo()

    ops = ops_for(grads[0])
    # Tensors the pipeline leaves dense only travel (both sides allreduce them): no work to time.
    compressed = [(i, g) for i, g in enumerate(grads)
                  if pipeline.plan(tuple(g.shape), "float32", ops) == "compressed"]

    def grace_round():
        for i, g in compressed:
            pipeline.reduce(g, f"g{i}", group)

    contenders = {"grace.powersgd(rank=2)": grace_round,
                  "torch powerSGD_hook": torch_hook(hooks.powerSGD_hook),
                  "torch batched_powerSGD_hook": torch_hook(hooks.batched_powerSGD_hook)}
    for name, fn in list(contenders.items()):
        try:
            fn()  # warm starts and buffers exist from here on
        except Exception as e:
            rows.append({"implementation": name, "error": f"{type(e).__name__} {e}".strip()[:100]})
            del contenders[name]
    medians = interleaved_medians(contenders, args.repeats, args.warmup, desc="powersgd")
    base = medians["grace.powersgd(rank=2)"]
    for name, seconds in medians.items():
        rows.append({"implementation": name, "round_s": seconds, "relative_to_grace": seconds / base})
    return rows


def powersgd_in_fresh_process(args) -> list[dict]:
    """``bench_powersgd`` in a process of its own. After the catalogue, this process holds
    TensorFlow's threads and a heap shaped by a hundred 100 MB tensors; in it grace's round (many
    small products and Python calls) came out 9 % slower than the hook's twice, against 0-28 %
    faster in a fresh process. Both sides get the fresh one."""
    with tempfile.TemporaryDirectory(prefix="grace-bench-") as tmp:
        out = os.path.join(tmp, "powersgd.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--skip-catalogue", "--powersgd",
                        "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--json", out],
                       check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=ROOT))
        with open(out) as f:
            return json.load(f)["powersgd"]


# --- wrapper overhead on 2 workers --------------------------------------------------------------
def overhead_worker(repeats: int) -> None:
    import horovod.torch as hvd
    import torch

    import grace as g

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    def make(prefix, compression):
        model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        kwargs = {"compression": compression} if compression is not None else {}
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{prefix}.{n}", p) for n, p in
                                                              model.named_parameters()], **kwargs)
        x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    steps = {"horovod": make("horovod", None), "grace.none()": make("grace", g.none())}
    times = {k: [] for k in steps}
    for _ in range(20):
        for step in steps.values():
            step()
    order = list(steps.items())
    for block in range(repeats):
        # Interleaved blocks of 20 steps, in turn first and second, so neither side always follows
        # the other.
        for name, step in (order if block % 2 == 0 else order[::-1]):
            hvd.allreduce(torch.zeros(1), name="barrier")
            start = time.perf_counter()
            for _ in range(20):
                step()
            times[name].append((time.perf_counter() - start) / 20)
    if hvd.rank() == 0:
        print("OVERHEAD " + json.dumps({k: float(np.median(v)) for k, v in times.items()}), flush=True)


def bench_overhead(args) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    out = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                          os.path.abspath(__file__), "--overhead-worker", "--repeats",
                          str(max(args.repeats, 30))], capture_output=True, text=True, env=env,
                         timeout=900)
    lines = [line for line in out.stdout.splitlines() if "OVERHEAD " in line]
    if not lines:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    times = json.loads(lines[-1].split("OVERHEAD ", 1)[1])
    return {**times, "ratio": times["grace.none()"] / times["horovod"]}


# --- main ---------------------------------------------------------------------------------------
def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    groups = sorted({(r["framework"], r["device"], r["case"]) for r in ok})
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 3.2 * len(groups)), squeeze=False)
    for ax, (fw, dev, case) in zip(axes[:, 0], groups):
        rs = [r for r in ok if (r["framework"], r["device"], r["case"]) == (fw, dev, case)]
        x = np.arange(len(rs))
        ax.bar(x, [r["compress_s"] / r["copy_s"] for r in rs], label="compress")
        ax.bar(x, [r["decompress_s"] / r["copy_s"] for r in rs],
               bottom=[r["compress_s"] / r["copy_s"] for r in rs], label="decompress")
        ax.scatter(x, [r["target"] for r in rs], marker="_", s=300, color="red", label="target", zorder=3)
        ax.set_xticks(x, [r["compressor"] for r in rs], rotation=45, ha="right")
        ax.set_ylabel("time / plain copy")
        ax.set_title(f"{fw} on {dev}, {case}")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- two checkouts side by side ------------------------------------------------------------------
def _commit(root: str) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                          text=True)
    return done.stdout.strip() or "?"


def bench_sides(args) -> dict:
    """The catalogue through the checkouts ``args.before`` and ``args.after``, each side in a
    process of its own, taking turns ``args.sides`` times: every run's rows, and each side's
    commit."""
    forwarded = ["--compressors", ",".join(args.compressors), "--frameworks", ",".join(args.frameworks),
                 "--numel", str(args.numel), "--model", args.model or "none",
                 "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    forwarded += ["--devices", args.devices] if args.devices else []
    runs = take_turns(__file__, args.before, args.after, args.sides, *forwarded)
    return {"before": _commit(args.before), "after": _commit(args.after),
            "options": forwarded, "runs": runs}


def sides_markdown(report: dict) -> str:
    """A row per framework, device, case and compressor that both sides measured without error:
    each side's median (compress + decompress) ms over its runs, the ratio after / before, and the
    range of the ratios of the runs taken in turn (run i of one side against run i of the other);
    the plain copy's the same way, for the state of the machine."""
    def key(row):
        return row["framework"], row["device"], row["case"], row["compressor"]

    def cost(row, what):
        return row["copy_s"] if what == "copy" else row["compress_s"] + row["decompress_s"]

    by = {side: [{key(r): r for r in run if "error" not in r} for run in runs]
          for side, runs in report["runs"].items()}
    keys = [key(r) for r in report["runs"]["after"][0]
            if all(key(r) in run for side in by.values() for run in side)]
    lines = [f"Before {report['before']}, after {report['after']}; medians of {len(by['after'])} "
             f"runs a side, taken in turn ({' '.join(report['options'])})", "",
             "| framework | case | compressor | before ms | after ms | after / before | range "
             "| copy after / before |", "|---|---|---|---:|---:|---:|---|---:|"]
    for k in keys:
        figures = {}
        for what in ("codec", "copy"):
            pairs = [(cost(b[k], what), cost(a[k], what)) for b, a in zip(by["before"], by["after"])]
            before = statistics.median(b for b, _ in pairs)
            after = statistics.median(a for _, a in pairs)
            figures[what] = before, after, [a / b for b, a in pairs]
        (before, after, ratios), (copy_b, copy_a, _) = figures["codec"], figures["copy"]
        framework, device, case, compressor = k
        where = framework if device == "cpu" else f"{framework} {device}"
        lines.append(f"| {where} | {case} | {compressor} | {before * 1e3:.1f} | {after * 1e3:.1f} | "
                     f"{after / before:.3f} | {min(ratios):.2f}-{max(ratios):.2f} | "
                     f"{copy_a / copy_b:.2f} |")
    return "\n".join(lines)


def _fixed_allocator() -> None:
    """Re-run this script with glibc's allocator in the state a long training run settles in: glibc
    raises its mmap threshold as large blocks are freed, up to 32 MiB (and the trim threshold to
    twice that), after which smaller temporaries are recycled from the heap and larger tensors get
    fresh pages. Left to adjust itself, it sometimes also serves a 100 MB tensor from a hole in the
    heap, and the same copy then takes 7 or 50 ms from one repeat to the next; pinned, the figures
    are repeatable."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform.startswith("linux"):
        # A side of a comparison keeps its path: its checkout's grace first (checkout_sides).
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(64 << 20),
                   PYTHONPATH=os.environ.get("PYTHONPATH") or ROOT)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def main(argv=None) -> dict:
    if argv is None:
        _fixed_allocator()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--compressors", default=",".join(grace.available()))
    parser.add_argument("--frameworks", default="torch,tf")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--model", choices=("resnet50", "none"), default="resnet50")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed rounds before the timed ones, per compressor (default 5)")
    parser.add_argument("--devices", help="only these of the devices present (cpu,cuda); default all")
    parser.add_argument("--powersgd", action="store_true", help="grace's PowerSGD against torch's hooks")
    parser.add_argument("--overhead", action="store_true", help="grace.none() against Horovod, 2 workers")
    parser.add_argument("--skip-catalogue", action="store_true")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--plot", help="bar chart of (compress + decompress) / copy, PNG")
    parser.add_argument("--before", metavar="DIR",
                        help="the checkout to compare with: the catalogue through both, in turns")
    parser.add_argument("--after", metavar="DIR", default=ROOT,
                        help="with --before: the other checkout (default: this one)")
    parser.add_argument("--sides", type=int, default=3, help="with --before: runs a side (default 3)")
    parser.add_argument("--overhead-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.overhead_worker:
        overhead_worker(args.repeats)
        return {}
    args.compressors = [c.strip() for c in args.compressors.split(",") if c.strip()]
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    for f in args.frameworks:
        if f not in ("torch", "tf"):
            parser.error(f"--frameworks: {f!r} is not one of torch, tf")
    args.model = None if args.model == "none" else args.model
    if args.measure:  # one side of --before: this process imports that checkout's grace
        assert_imported_from(args.measure)
        print("\n" + json.dumps(bench_catalogue(args)))
        return {}
    for c in args.compressors:
        if c not in grace.available():
            parser.error(f"--compressors: {c!r} is not one of {', '.join(grace.available())}")

    for path in (args.json, args.plot):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    report: dict = {}
    if args.before:
        report = bench_sides(args)
        print(sides_markdown(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return report
    if not args.skip_catalogue:
        rows = bench_catalogue(args)
        report["catalogue"] = rows
        print(catalogue_table(rows))
        comparison = tf_vs_torch(rows)
        if comparison:
            print("\nTensorFlow (tf.function) against PyTorch (eager), CPU:\n\n" + comparison)
        if args.plot:
            plot(rows, args.plot)
    if args.powersgd:
        report["powersgd"] = (bench_powersgd(args) if args.skip_catalogue
                              else powersgd_in_fresh_process(args))
        print("\nPowerSGD rank 2, ResNet-50 shapes, one round without the network:\n")
        print("| implementation | round ms | relative to grace |\n|---|---:|---:|")
        for r in report["powersgd"]:
            if "error" in r:
                print(f"| {r['implementation']} | fails: {r['error']} | |")
                continue
            print(f"| {r['implementation']} | {r['round_s'] * 1e3:.1f} | {r['relative_to_grace']:.2f} |")
    if args.overhead:
        o = report["overhead"] = bench_overhead(args)
        print(f"\nWrapper overhead, 2 workers, MLP step: Horovod {o['horovod'] * 1e3:.2f} ms, "
              f"grace.none() {o['grace.none()'] * 1e3:.2f} ms, ratio {o['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
