"""The quality benchmark (``make quality``): does every compressor, at its defaults, reach the accuracy
of uncompressed training with the optimizer the user already has?

Every compressor of the catalogue and Horovod's own uncompressed allreduce (``fp32``) train, on 2
real Horovod workers, PyTorch and TensorFlow:

- ``mnist`` (the MLP of ``workloads.py`` on Fashion-MNIST) to convergence, 10 passes over the data,
  once with its SGD (lr 0.05, momentum 0.9) and once with Adam (lr 1e-3);
- ``cnn`` (the small residual network of ``cnn.py`` on the same images) with the same SGD and Adam,
  2 passes over the data, its test accuracy measured at each quarter pass;
- ``lstm`` (the character LSTM on Shakespeare) with its SGD, 4,000 steps, near fp32's plateau;
- ``words`` (the word model with a sparse embedding table) with its SGD, 4,000 steps: sparse
  gradients, Horovod's own sparse allgather as fp32.

signSGD and signum run with the learning rate their docs give (``grace.compressors.sign``); every
other compressor with the workload's. Reported per run: the final metric and its gap to fp32 of
the same framework, workload and optimizer, against the target of docs/quality.md; bytes per step;
the training time until fp32's final metric is reached; and a plot of the metric against epoch,
one panel per compressor.

    .venv/bin/python -m scripts.quality --out out/quality            # the whole matrix (hours)
    .venv/bin/python -m scripts.quality --frameworks torch --cases mnist-sgd --compressors fp32,dgc
    .venv/bin/python -m scripts.quality --from-json out/quality/*.json   # tables and plots only
    .venv/bin/python -m scripts.quality --cases lstm-sgd --compressors fp32,dgc --epochs 30  # further

Runs are on localhost (quality does not depend on the link); each is a ``compare_worker.py`` job.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time

from tqdm import tqdm

from grace.compressors import sign
from scripts import compare, plots, workloads

# (workload, optimizer) cases, and the budget of each workload (epochs, steps per epoch): mnist's
# epoch is one pass over the 60,000 images with 2 workers of 64. The LSTM's 4,000 steps are where
# fp32's validation perplexity improves by about 1% per further 400 (5.4 here, from 9 after the first
# 300); a full plateau takes several times longer than this 2-core machine can give 40 runs.
CASES = {"mnist-sgd": ("mnist", "sgd"), "mnist-adam": ("mnist", "adam"), "cnn-sgd": ("cnn", "sgd"),
         "cnn-adam": ("cnn", "adam"), "lstm-sgd": ("lstm", "sgd"), "words-sgd": ("words", "sgd")}
# words: 10 × 400 steps of 2 × 128 windows, about half a pass over the 2.0 M training words.
# cnn: 8 quarter passes (2 passes), evaluated at each quarter for its time to accuracy.
BUDGET = {"mnist": (10, 468), "cnn": (8, 117), "lstm": (10, 400), "words": (10, 400)}
# The largest gap to fp32 (accuracy points) each compressor should keep on the image models (the
# issue's targets); perplexity gaps are reported, not judged.
TARGET_POINTS = {"qsgd": 2.0, "terngrad": 2.0, "signsgd": 3.0, "signum": 3.0}
DEFAULT_TARGET = 1.0
SIGN_METHODS = ("signsgd", "signum")
# TensorFlow's training loops other than the benchmark's (compare_worker.py --loop): set-ups of their
# own, each compared with fp32 of the same loop, and kept out of the safety table by their label.
LOOP_LABELS = {"fit": " [model.fit]", "tape": " [tape]"}


def code_version() -> str | None:
    """The commit the runs measure (``+`` if the tree had changes), recorded with each run."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=compare.ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--",
                                                                   "grace", "frameworks") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def passes(run: dict) -> int:
    """How many epochs (evaluations) a run recorded: its length, which a set-up includes."""
    return len(run.get("epochs") or [])


DEFAULT_CHANGED = {"topk": ("memory", "residual", "momentum", "2026-11-30T00:30:00+00:00")}
"""Compressors whose default changed after runs of the record: (the parameter, the value their runs
at the defaults ran with before the change, its value since, the date of the change). Top-k's
error feedback moved onto the velocity ("Top-k's momentum" in docs/quality.md): where a wrapper
takes SGD's momentum over the two compute different bits, elsewhere (Adam, a plain SGD, the tape,
DDP) the same, so only the former runs are renamed (``as_run``)."""
WORKLOADS = {"mnist": workloads.MNIST, "cnn": workloads.CNN, "lstm": workloads.LSTM,
             "words": workloads.WORDS}


def without_default_loop(run: dict) -> dict:
    """``run`` without ``loop: step``, which TensorFlow's worker records since it took ``--loop``:
    the benchmark's own loop, which the runs recorded before it ran too, so that a run of it and an
    earlier one of the same set-up are one set-up (the later replacing the earlier)."""
    if run.get("loop") != "step":
        return run
    return {k: v for k, v in run.items() if k != "loop"}


def takes_sgd_momentum(run: dict) -> bool:
    """Whether Horovod's wrapper (PyTorch's optimizer, TensorFlow's step or ``model.fit``, not the
    tape) saw an SGD with momentum in this run, which a compressor's memory can take over."""
    if run["framework"] not in ("torch", "tf") or run.get("optimizer", "sgd") != "sgd":
        return False
    if run.get("loop") == "tape":
        return False
    momentum = run.get("optimizer_momentum")
    if momentum is None:
        momentum = WORKLOADS.get(run["workload"], {}).get("momentum", 0.0)
    return momentum > 0


def as_run(run: dict) -> dict:
    """``run`` with its compression named by what ran (``DEFAULT_CHANGED``): a run recorded before
    a compressor's default changed, where the change computes other bits, names the value it ran
    with (``topk`` -> ``topk(memory=residual)``), and its run of today's default is named as the
    default (``topk(memory=momentum)`` -> ``topk``). The record keeps what each run wrote."""
    if compare.is_named(run["compression"]):
        return run
    params = json.loads(run["compression"])
    change = DEFAULT_CHANGED.get(params["compressor"])
    if change is None:
        return run
    param, before, now, since = change
    if (run.get("finished") or "") >= since or not takes_sgd_momentum(run):
        return run
    if param not in params:
        params[param] = before
    elif params[param] == now:
        del params[param]
    else:
        return run
    return {**run, "compression": json.dumps(params)}


def merge(runs_per_file: list[list[dict]]) -> list[dict]:
    """One run per set-up (workload, optimizer, framework, compression, seed, length): the one
    finished last by its recorded date (``finished``); runs recorded before dates were (none)
    count as older than any dated run, and among them the later file wins. A run of another
    length (``--epochs``) is another set-up: it shadows none. fp32 is kept once per commit as
    well: it is the baseline of the runs of its own code (``summarize``), which a later fp32 of
    other code must not take from them."""
    merged: dict = {}
    for runs in runs_per_file:
        for r in map(as_run, map(without_default_loop, runs)):
            key = (r["workload"], r.get("optimizer", "sgd"), r["framework"], r["compression"],
                   r.get("seed", 0), r.get("optimizer_momentum"), passes(r), r.get("init"),
                   r.get("loop"), r.get("commit") if r["compression"] == "fp32" else None)
            if key not in merged or finished_later(r, merged[key]):
                merged[key] = r
    return list(merged.values())


def finished_later(run: dict, than: dict) -> bool:
    """Whether ``run`` replaces ``than``: finished at the same time or later by its recorded date;
    a run recorded before dates were (none) counts as older than any dated run, and of two such
    the one met later wins."""
    return run.get("finished", "") >= than.get("finished", "")


def is_accuracy(workload: str) -> bool:
    """Whether the workload is judged by test accuracy (the image models), else by perplexity."""
    return compare.METRIC[workload][0] == "test_accuracy"


def learning_rate(name: str, workload: str, optimizer: str) -> float | None:
    """The learning rate a run uses: the sign methods' documented one (an Adam-sized rate for the
    model: the LSTM's is ``workloads.LSTM["sign_lr"]``), else the workload's (``None``)."""
    if name not in SIGN_METHODS:
        return None
    cfg = WORKLOADS.get(workload, {})
    if "sign_lr" in cfg:
        return cfg["sign_lr"]
    momentum = cfg.get("momentum", 0.0) if optimizer == "sgd" else 0.0  # the image models' SGD
    return sign.learning_rate(momentum_in_optimizer=0.0 if name == "signum" else momentum)


def is_fp32(label: str) -> bool:
    """Whether a row's label is uncompressed training: ``fp32``, an earlier code's ``fp32 at
    COMMIT`` that runs of that code are measured against (``summarize``), or fp32 of a set-up of
    its own (``fp32 [Keras init]``, ``fp32 [model.fit]``)."""
    return label == "fp32" or label.startswith(("fp32 at ", "fp32 ["))


def compressor_of(compression: str) -> str:
    """The algorithm's name (its learning rate and target go by it); PyTorch's DDP hooks by theirs."""
    if compare.is_named(compression):
        return compression
    return json.loads(compression)["compressor"]


def momentum_to_compressor(compression: str, optimizer: str = "sgd") -> tuple[str, float | None]:
    """For a DDP run whose momentum goes to the compressor (``--momentum-to compressor``): what a
    DDP user does by hand where Horovod's wrapper would take the momentum over (docs/ddp.md). With
    SGD, a compressor that applies momentum itself is given the workload's (``dgc(momentum=0.9)``,
    ``signum(beta=0.9)``) and random-k none (Horovod turns it off); with Adam, one that takes
    ``beta_1`` over is given Adam's 0.9. The optimizer then has none (SGD's momentum, Adam's
    ``beta_1``): (the compression, the optimizer's momentum, ``None`` where it keeps its own).
    Random-k's takeover of Adam's moments has no by-hand equivalent: left as it is."""
    if compare.is_named(compression):
        return compression, None
    import grace
    from grace.memories.residual import DelayedResidualMemory
    from grace.momentum import owner

    params = json.loads(compression)
    part = owner(grace.from_params(dict(params)))
    if part is None or (optimizer == "adam" and not part.takes_adam_beta1):
        return compression, None
    if not isinstance(part, DelayedResidualMemory):
        params.setdefault(part.momentum_param, 0.9 if optimizer == "adam" else workloads.MNIST["momentum"])
    return json.dumps(params), 0.0


def run_matrix(args) -> list[dict]:
    names = compare.split(args.compressors)
    compressions = [compare.parse_compression(c) for c in names]
    cases = [CASES[c] for c in compare.split(args.cases)]
    frameworks = compare.split(args.frameworks)
    seeds = [int(s) for s in compare.split(args.seeds)]
    matrix = [(w, o, fw, c, seed) for seed in seeds for (w, o) in cases for fw in frameworks
              for c in compressions if compare.runs_under(fw, c)]
    results = []
    with tqdm(matrix, desc="quality runs", unit="run") as bar:
        for workload, optimizer, fw, comp, seed in bar:
            name = compressor_of(comp)
            bar.set_postfix_str(f"{workload}-{optimizer} {fw} {compare.label(comp)} seed {seed}")
            epochs, steps = BUDGET[workload]
            epochs = epochs if args.epochs is None else args.epochs
            run_args = argparse.Namespace(epochs=epochs, steps=steps, exchange_steps=steps,
                                          timeout=args.timeout)
            extra = ["--optimizer", optimizer, "--seed", str(seed)]
            init = args.init if args.init != "default" and fw == "torch" else None
            if init:
                extra += ["--init", init]
            loop = args.loop if args.loop != "step" and fw == "tf" else None
            if loop:
                extra += ["--loop", loop]
            given = None
            if args.momentum_to == "compressor" and fw == "ddp" and is_accuracy(workload):
                comp, given = momentum_to_compressor(comp, optimizer)
                if given is not None:
                    extra += ["--momentum", repr(given)]
            lr = learning_rate(name, workload, optimizer)
            if lr is not None:
                extra += ["--lr", repr(lr)]
            if name in SIGN_METHODS and workload == "lstm":
                # Clipping the combined gradient after synchronize() would scale the ±1 votes
                # down by the root of their count (docs/quality.md); their steps are ±lr anyway.
                extra += ["--clip", "0"]
            row = compare.run_one(fw, workload, comp, None, 2, run_args, emulate=False, extra=tuple(extra))
            if init:
                row["init"] = init
            if loop:
                row["loop"] = loop
            row.update(rate="unshaped (localhost)", optimizer=optimizer, lr=lr, seed=seed,
                       optimizer_momentum=given,
                       finished=datetime.datetime.now(datetime.timezone.utc).isoformat(
                           timespec="seconds"), commit=code_version())
            results.append(row)
            final = row["epochs"][-1] if row["status"] == "ok" else None
            metric = compare.METRIC[workload][0]
            bar.write(f"{workload}-{optimizer:4s} {fw:5s} {compare.label(comp):10s} seed {seed} "
                      + (f"{metric} {final[metric]:.4f}" if final else row["status"]))
            with open(os.path.join(args.out, "quality.json"), "w") as f:
                json.dump(results, f, indent=1)  # kept as it goes: a long matrix survives a stop
    return results


# --- tables -------------------------------------------------------------------------------------
def _final(row: dict) -> float | None:
    if row.get("status") != "ok":
        return None
    return row["epochs"][-1][compare.METRIC[row["workload"]][0]]


def _time_to(row: dict, target: float) -> float | None:
    key, better, _ = compare.METRIC[row["workload"]]
    for epoch in row.get("epochs", []):
        if (epoch[key] >= target) if better == "max" else (epoch[key] <= target):
            return epoch["train_wall_s"]
    return None


def summarize(results: list[dict]) -> list[dict]:
    """One row per run with its gap to fp32 (same framework, workload, optimizer, seed and length)
    of the same code: a run recorded with another commit than fp32's (runs before commits were
    recorded count as one unknown version) gets no gap, since fp32 itself moves when the code
    does. Where fp32 ran with several commits, each is the baseline of its own code's runs: the
    one finished last is the row ``fp32``, an earlier one that some run is measured against is the
    row ``fp32 at COMMIT`` (``baseline_only``), so that every gap's baseline is in the table."""
    def case_of(r: dict) -> tuple:
        return (r["workload"], r.get("optimizer", "sgd"), r["framework"], r.get("seed", 0), passes(r),
                r.get("init"), r.get("loop"))

    fp32 = [r for r in results if r["compression"] == "fp32"]
    baseline = {(case_of(r), r.get("commit")): _final(r) for r in fp32}
    shown: dict = {}
    for r in fp32:
        if case_of(r) not in shown or finished_later(r, shown[case_of(r)]):
            shown[case_of(r)] = r
    measured = {(case_of(r), r.get("commit")) for r in results if r["compression"] != "fp32"}
    rows = []
    for r in results:
        case = case_of(r)
        baseline_only = r["compression"] == "fp32" and shown[case] is not r
        if baseline_only and (case, r.get("commit")) not in measured:
            continue  # replaced by a later fp32, and no run of its code left to measure
        name = compressor_of(r["compression"])
        ref = baseline.get((case, r.get("commit")))
        final = _final(r)
        row = {"workload": r["workload"], "optimizer": case[1], "framework": r["framework"],
               "compressor": compare.label(r["compression"])
               + (f" at {r.get('commit') or 'unrecorded code'}" if baseline_only else "")
               + (" [Keras init]" if r.get("init") else "")
               + LOOP_LABELS.get(r.get("loop"), ""),
               "lr": r.get("lr"), "seed": case[3],
               "status": r.get("status"), "final": final, "passes": case[4]}
        if baseline_only:
            row["baseline_only"] = True
        if r.get("loop"):
            row["loop"] = r["loop"]
        if r.get("optimizer_momentum") is not None:
            row["optimizer_momentum"] = r["optimizer_momentum"]
            row["horovod_twin"] = horovod_twin(r["compression"])
        if final is not None and ref is not None:
            if is_accuracy(r["workload"]):
                row["gap"] = round(100 * (ref - final), 2)  # accuracy points below fp32
                row["target"] = case_target(name, r["workload"])
                row["met"] = name == "fp32" or row["gap"] <= row["target"]
            else:
                row["gap"] = round(100 * (final / ref - 1), 2)  # % of fp32's perplexity above it
            row["time_to_fp32_s"] = _time_to(r, ref)
        if r.get("status") == "ok":
            row["bytes_per_step"] = round(r["bytes_per_step"])
            row["step_ms"] = round(r["step_s"] * 1e3, 1)
            row["curve"] = [e[compare.METRIC[r["workload"]][0]] for e in r["epochs"]]
        rows.append(row)
    return rows


def at_benchmark_length(rows: list[dict]) -> list[dict]:
    """The rows of runs of their case's usual length (the one most of its framework's runs of
    that workload and optimizer have): the tables compare like with like; longer runs, made to
    follow a case further, stay in the summary."""
    counts: dict = {}
    for r in rows:
        case = (r["workload"], r["optimizer"], r["framework"])
        counts.setdefault(case, {}).setdefault(r.get("passes", 0), 0)
        counts[case][r.get("passes", 0)] += 1
    usual = {case: max(lengths, key=lambda n: (lengths[n], -n)) for case, lengths in counts.items()}
    return [r for r in rows
            if r.get("passes", 0) == usual[(r["workload"], r["optimizer"], r["framework"])]]


def seeds_markdown(rows: list[dict]) -> str:
    """Where a set-up ran with several seeds (initial weights and data order; each gap is to fp32
    of the same seed): the gap per seed, their mean and their spread, against the target."""
    by_setup: dict = {}
    for r in rows:
        if r.get("gap") is not None and not is_fp32(r["compressor"]):
            key = (r["workload"], r["optimizer"], r["framework"], r["compressor"],
                   r.get("optimizer_momentum"))
            by_setup.setdefault(key, {})[r.get("seed", 0)] = r
    lines = []
    for (workload, optimizer, fw, name, _), runs in by_setup.items():
        if len(runs) < 2:
            continue
        gaps = [runs[s]["gap"] for s in sorted(runs)]
        mean = sum(gaps) / len(gaps)
        target = next(iter(runs.values())).get("target")
        verdict = "–" if target is None else f"≤ {target:g} {'✓' if mean <= target else '✗'}"
        per_seed = ", ".join(f"{s}: {runs[s]['gap']:+.2f}" for s in sorted(runs))
        lines.append(f"| {workload}, {optimizer} | {fw} | {name} | {per_seed} | {mean:+.2f} | "
                     f"{max(gaps) - min(gaps):.2f} | {verdict} |")
    if not lines:
        return ""
    return "\n".join(["\n### Across seeds: gap to fp32 of the same seed (points; % perplexity)",
                      "| case | framework | compressor | gap per seed | mean | spread | target (mean) |",
                      "|---|---|---|---|---:|---:|---|"] + lines)


PERPLEXITY_TARGET = {1.0: 2.0, 2.0: 5.0, 3.0: 10.0}
"""The perplexity workloads' targets (% above fp32's) for each accuracy target (points)."""
SAFETY_CASES = (("mnist", "sgd", "mnist MLP, SGD"), ("mnist", "adam", "mnist MLP, Adam"),
                ("cnn", "sgd", "CNN, SGD"), ("cnn", "adam", "CNN, Adam"),
                ("lstm", "sgd", "char LSTM, SGD"), ("words", "sgd", "words, SGD"))


def defaults_gaps(rows: list[dict], names: list[str]) -> dict[tuple, list[float]]:
    """(compressor, workload, optimizer, framework) -> the gap of every seed run of each compressor
    at its defaults (``names``), at the case's usual length, through Horovod; an empty list where
    it ran without fp32 of the same code to compare with."""
    gaps: dict = {}
    for r in at_benchmark_length(rows):
        if r["framework"] in ("torch", "tf") and r["compressor"] in names:
            key = (r["compressor"], r["workload"], r["optimizer"], r["framework"])
            gaps.setdefault(key, [])
            if r.get("gap") is not None:
                gaps[key].append(r["gap"])
    return gaps


def case_target(name: str, workload: str) -> float:
    """The compressor's target on the workload: points below fp32, or % of its perplexity above."""
    target = TARGET_POINTS.get(name, DEFAULT_TARGET)
    return target if is_accuracy(workload) else PERPLEXITY_TARGET[target]


def _cases_table(rows: list[dict], names: list[str], show) -> str:
    """A row per compressor at its defaults (``names``), a cell per case, PyTorch / TensorFlow:
    ``show(name, workload, gaps, mean)`` of the cell's gaps over every seed run; – not run; ? run
    without fp32 of the same code to compare."""
    gaps = defaults_gaps(rows, names)

    def cell(name: str, workload: str, optimizer: str, framework: str) -> str:
        found = gaps.get((name, workload, optimizer, framework))
        if found is None:
            return "–"
        return show(name, workload, found, sum(found) / len(found)) if found else "?"

    lines = ["| compressor | " + " | ".join(label for _, _, label in SAFETY_CASES) + " |",
             "|---|" + "---|" * len(SAFETY_CASES)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(
            f"{cell(name, w, o, 'torch')} / {cell(name, w, o, 'tf')}" for w, o, _ in SAFETY_CASES) + " |")
    return "\n".join(lines)


def _unit(workload: str) -> str:
    return "" if is_accuracy(workload) else "%"


def safety_markdown(rows: list[dict], names: list[str]) -> str:
    """Which models and optimizers each compressor (at its defaults: ``names``) meets its target
    on, PyTorch / TensorFlow: ✓, or ✗ with the mean gap (points below fp32; % of perplexity
    above), over every seed run; – not run; ? run without fp32 of the same code to compare."""
    return _cases_table(rows, names, lambda name, workload, gaps, mean: (
        "✓" if mean <= case_target(name, workload) else f"✗ {mean:+.1f}{_unit(workload)}"))


def gaps_markdown(rows: list[dict], names: list[str]) -> str:
    """The safety table's figures: each compressor's mean gap to fp32 of the same code and seed
    (points below it; % of its perplexity above), PyTorch / TensorFlow, with the number of seeds
    in brackets where more than one ran and ✗ where the mean misses the target; – not run; ? run
    without fp32 of the same code to compare."""
    return _cases_table(rows, names, lambda name, workload, gaps, mean: (
        f"{mean:+.2f}{_unit(workload)}" + (f" ({len(gaps)})" if len(gaps) > 1 else "")
        + (" ✗" if mean > case_target(name, workload) else "")))


def markdown(rows: list[dict]) -> str:
    rows = at_benchmark_length(rows)
    seeds = seeds_markdown(rows)
    rows = [r for r in rows if r.get("seed", 0) == 0]  # the main tables and plots: seed 0
    lines = []
    horovod = [r for r in rows if r["framework"] != "ddp"]  # DDP's rows: ddp_markdown
    for case in dict.fromkeys((r["workload"], r["optimizer"]) for r in horovod):
        workload, optimizer = case
        key = compare.METRIC[workload][0]
        gap = "gap (points)" if is_accuracy(workload) else "gap (% perplexity)"
        lines += [f"\n### {workload}, {optimizer}: final {key}",
                  f"| compressor | lr | torch | torch {gap} | tf | tf {gap} | target | bytes/step "
                  f"(torch) | step ms (torch, tf) | torch s to fp32's final | tf s to fp32's final |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        by_name: dict = {}
        for r in horovod:
            if (r["workload"], r["optimizer"]) == case:
                by_name.setdefault(r["compressor"], {})[r["framework"]] = r

        def cell(r, field, fmt="{}"):
            if r is None or r.get(field) is None:
                return "–" if r is None or r.get("status") == "ok" else (r.get("status") or "–")[:40]
            return fmt.format(r[field])

        for name, fws in by_name.items():
            t, f = fws.get("torch"), fws.get("tf")
            any_row = t or f
            target = any_row.get("target")
            met = [x.get("met") for x in (t, f) if x is not None and x.get("met") is not None]
            verdict = "" if target is None or is_fp32(name) else \
                f"≤ {target:g} {'✓' if met and all(met) else '✗'}"
            lines.append(" | ".join([
                f"| {name}", cell(any_row, "lr", "{:g}") if any_row.get("lr") else "–",
                cell(t, "final", "{:.4f}"), cell(t, "gap", "{:+.2f}"), cell(f, "final", "{:.4f}"),
                cell(f, "gap", "{:+.2f}"), verdict, cell(t, "bytes_per_step", "{:,}"),
                f"{cell(t, 'step_ms')}, {cell(f, 'step_ms')}", cell(t, "time_to_fp32_s", "{:.0f}"),
                cell(f, "time_to_fp32_s", "{:.0f}")]) + " |")
    return ("\n".join(lines) + ddp_markdown(rows) + seeds).lstrip("\n")


def followed_markdown(rows: list[dict]) -> str:
    """Runs followed past the benchmark's length (``--epochs`` above ``BUDGET``'s), per case: fp32's
    metric, and each compressor's gap to fp32 of the same framework, seed and code (``summarize``),
    at the benchmark's length and at the end of the run, both read off the same runs' curves."""
    def gap(workload: str, value: float, ref: float) -> str:
        if is_accuracy(workload):
            return f"{100 * (ref - value):+.2f}"  # points below fp32, as ``summarize``
        return f"{100 * (value / ref - 1):+.1f}%"  # % of fp32's perplexity above it

    longer = [r for r in rows if r.get("curve") and r.get("seed", 0) == 0
              and r["passes"] > BUDGET[r["workload"]][0] and not r.get("baseline_only")]
    lines = []
    for case in dict.fromkeys((r["workload"], r["optimizer"]) for r in longer):
        workload, optimizer = case
        here = [r for r in longer if (r["workload"], r["optimizer"]) == case]
        frameworks = list(dict.fromkeys(r["framework"] for r in here))
        budget = BUDGET[workload][0]
        ends = {fw: max(r["passes"] for r in here if r["framework"] == fw) for fw in frameworks}
        head = []
        for fw in frameworks:
            name = compare.FRAMEWORK_NAMES.get(fw, fw)
            head += [f"{name} at {budget} epochs", f"{name} at {ends[fw]}"]
        lines += [f"\n### {workload}, {optimizer}: fp32's {compare.METRIC[workload][0]}, and each "
                  f"compressor's gap to it, at the benchmark's length and at the run's end",
                  "| compressor | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
        by_name: dict = {}
        for r in here:
            by_name.setdefault(r["compressor"], {})[r["framework"]] = r
        fp32 = by_name.get("fp32", {})
        for name, fws in by_name.items():
            cells = []
            for fw in frameworks:
                r, ref = fws.get(fw), fp32.get(fw)
                for at in (budget, ends[fw]):
                    if r is None or len(r["curve"]) < at:
                        cells.append("–")
                    elif name == "fp32":
                        cells.append(f"{r['curve'][at - 1]:.3f}")
                    elif ref is None or r.get("gap") is None or len(ref["curve"]) < at:
                        cells.append("–")  # no fp32 of the same code and length to compare with
                    else:
                        cells.append(gap(workload, r["curve"][at - 1], ref["curve"][at - 1]))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n")


def ddp_markdown(rows: list[dict]) -> str:
    """PyTorch through DDP (framework ``ddp``), per case: each hook's final metric and its gap to
    DDP without a hook (``fp32``) of the same seed, judged as under Horovod, beside Horovod's run
    of the same compressor in PyTorch (``torch``) where there is one. Seed 0, as ``markdown``.
    No times: the throughput comparison is compare.py's, measured on a machine doing nothing else."""
    rows = [r for r in rows if r.get("seed", 0) == 0]
    lines = []
    for case in dict.fromkeys((r["workload"], r["optimizer"]) for r in rows if r["framework"] == "ddp"):
        workload, optimizer = case
        key = compare.METRIC[workload][0]
        unit = "points" if is_accuracy(workload) else "% perplexity"
        lines += [f"\n### {workload}, {optimizer}: PyTorch DDP, final {key}",
                  f"| hook | lr | DDP | gap to DDP without a hook ({unit}) | target | Horovod (PyTorch) "
                  "| bytes/step |", "|---|---:|---:|---:|---:|---:|---:|"]
        horovod = {r["compressor"]: r for r in rows
                   if (r["workload"], r["optimizer"], r["framework"]) == (*case, "torch")}
        for r in rows:
            if (r["workload"], r["optimizer"], r["framework"]) != (*case, "ddp"):
                continue
            name = "DDP, no hook (fp32)" if r["compressor"] == "fp32" else r["compressor"]
            if r.get("optimizer_momentum") is not None:
                name += (f", Adam's beta_1 {r['optimizer_momentum']:g}" if optimizer == "adam"
                         else f", SGD's momentum {r['optimizer_momentum']:g}")
            if r.get("final") is None:
                lines.append(f"| {name} | {(r.get('status') or '')[:60]} | | | | | |")
                continue
            target = r.get("target")
            verdict = "" if target is None or is_fp32(r["compressor"]) else \
                f"≤ {target:g} {'✓' if r.get('met') else '✗'}"
            # Given by hand, the momentum Horovod's wrapper takes over: set beside Horovod's run.
            same = horovod.get(same_bits_under_horovod(r)) or horovod.get(r.get("horovod_twin"))
            other = (same or {}).get("final")
            lines.append(" | ".join([
                f"| {name}", f"{r['lr']:g}" if r.get("lr") else "–", f"{r['final']:.4f}",
                "–" if r.get("gap") is None else f"{r['gap']:+.2f}", verdict,
                "–" if other is None else f"{other:.4f}", f"{r['bytes_per_step']:,}"]) + " |")
    return "\n" + "\n".join(lines) if lines else ""


def same_bits_under_horovod(ddp_run: dict) -> str:
    """The label of the Horovod run (PyTorch) that computes what a DDP run computed: the same, but
    where Horovod's wrapper now takes SGD's momentum over for a compressor at its defaults
    (``DEFAULT_CHANGED``) and the hook, seeing no optimizer, cannot: there the variant the hook
    runs (``topk`` under DDP is ``topk(memory=residual)`` under Horovod)."""
    name = ddp_run["compressor"]  # a label: ``topk``, ``topk(ratio=0.01)``
    change = DEFAULT_CHANGED.get(name.split("(")[0])
    if change is None or ddp_run.get("optimizer_momentum") is not None or f"{change[0]}=" in name:
        return name
    as_horovod = {"framework": "torch", "workload": ddp_run["workload"],
                  "optimizer": ddp_run["optimizer"]}
    if not takes_sgd_momentum(as_horovod):
        return name
    given = f"{change[0]}={change[1]}"
    return f"{name[:-1]}, {given})" if name.endswith(")") else f"{name}({given})"


def horovod_twin(compression: str) -> str:
    """For a DDP run given its momentum by hand (``momentum_to_compressor``): the label of the
    Horovod run that took that momentum over from the optimizer, its spec without the momentum
    parameter of the compressor's momentum owner (``momentum=``, signum's ``beta=``)."""
    if compare.is_named(compression):
        return compression
    import grace
    from grace.momentum import owner

    params = json.loads(compression)
    part = owner(grace.from_params(dict(params)))
    if part is not None:
        params.pop(part.momentum_param, None)
    return compare.label(json.dumps(params))


# --- plot ---------------------------------------------------------------------------------------
SERIES = {("mnist", "sgd", "torch"): ("tab:blue", "o"), ("mnist", "sgd", "tf"): ("tab:cyan", "s"),
          ("mnist", "adam", "torch"): ("tab:red", "^"), ("mnist", "adam", "tf"): ("tab:orange", "v"),
          ("lstm", "sgd", "torch"): ("tab:green", "D"), ("lstm", "sgd", "tf"): ("tab:olive", "P"),
          ("words", "sgd", "torch"): ("tab:purple", "X"), ("words", "sgd", "tf"): ("tab:brown", "*"),
          ("mnist", "sgd", "ddp"): ("navy", "<"), ("mnist", "adam", "ddp"): ("darkred", ">"),
          ("lstm", "sgd", "ddp"): ("darkgreen", "d"), ("words", "sgd", "ddp"): ("indigo", "h")}
SERIES.update({("cnn", *rest): style for (workload, *rest), style in list(SERIES.items())
               if workload == "mnist"})  # its own figure: the MLP's colours


def plotted(rows: list[dict]) -> list[dict]:
    """The rows the plots draw: seed 0 at the benchmark's length, without an earlier code's fp32
    (``baseline_only``): fp32's curve is the latest one's; and not TensorFlow's other loops
    (``LOOP_LABELS``), whose runs train as the benchmark's loop, bit for bit (tests/test_tf_loops.py)."""
    return [r for r in at_benchmark_length(rows) if r.get("seed", 0) == 0 and not r.get("baseline_only")
            and not r.get("loop")]


def plot(rows: list[dict], path: str) -> str | None:
    """Small multiples: one panel per compressor, the metric against epoch, one line per framework
    and optimizer, fp32's curves in grey behind; accuracy (mnist) and perplexity (lstm) side by
    side in separate figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = None
    rows = plotted(rows)
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ok = [r for r in rows if r["workload"] == workload and r.get("curve")]
        names = list(dict.fromkeys(r["compressor"] for r in ok))
        if not names:
            continue
        cols = 5
        lines_ = -(-len(names) // cols)
        fig, axes = plt.subplots(lines_, cols, figsize=(3.2 * cols, 2.6 * lines_), sharex=True,
                                 sharey=True, squeeze=False)
        reference = {(r["optimizer"], r["framework"]): r["curve"] for r in ok if r["compressor"] == "fp32"}
        for ax, name in zip(axes.flat, names):
            for (optimizer, fw), curve in reference.items():
                ax.plot(range(1, len(curve) + 1), curve, color="0.8", lw=2.5, zorder=1)
            for r in ok:
                if r["compressor"] != name:
                    continue
                color, marker = SERIES[(workload, r["optimizer"], r["framework"])]
                ax.plot(range(1, len(r["curve"]) + 1), r["curve"], color=color, marker=marker,
                        ms=3, lw=1.2, label=f"{r['framework']} {r['optimizer']}", zorder=2)
            ax.set_title(name, fontsize=9)
            ax.grid(alpha=0.3)
        for ax in axes.flat[len(names):]:
            ax.axis("off")
        key = compare.METRIC[workload][0]
        if is_accuracy(workload):
            # fp32's lowest point sets the floor; a run of other compressors alone uses its own.
            floor = [r for r in ok if r["compressor"] == "fp32"] or ok
            low = min(min(r["curve"]) for r in floor) - 0.05
            axes[0][0].set_ylim(max(0.5, low), None)
        else:
            axes[0][0].set_yscale("log")
        plots.shared_legend(fig, axes, "fp32 (grey)", "0.8", 2.5)
        fig.supxlabel("epoch")
        fig.supylabel(key)
        fig.suptitle(f"{workload}: {key} against epoch, each compressor at its defaults")
        fig.tight_layout(rect=(0, 0, 1, 0.94))  # the top strip: the title, and the legend at right
        out = path.replace(".png", f"_{workload}.png")
        fig.savefig(out, dpi=100)
        plt.close(fig)
        made = out
    return made


def write(results: list[dict], out: str) -> list[dict]:
    rows = summarize(results)
    report = markdown(rows)
    with open(os.path.join(out, "quality.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(out, "quality_summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    import grace

    # docs/catalogue.md's "Where each is measured safe" (made from data/quality/runs/).
    with open(os.path.join(out, "safety.md"), "w") as f:
        f.write(safety_markdown(rows, grace.available()) + "\n")
    plot(rows, os.path.join(out, "quality.png"))
    print("\n" + report)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--frameworks", default="torch,tf")
    parser.add_argument("--engines", default="horovod",
                        help="horovod: the frameworks through Horovod; ddp: PyTorch through "
                             "DistributedDataParallel (rows of framework 'ddp'; fp32 is DDP without "
                             "a hook; PyTorch's own hooks by their names in torch_hooks.py); "
                             "horovod,ddp: both")
    parser.add_argument("--compressors", default=None,
                        help="comma-separated (default: fp32 and every compressor of the catalogue)")
    parser.add_argument("--momentum-to", choices=("optimizer", "compressor"), default="optimizer",
                        help="under DDP (mnist), where the optimizer's momentum (SGD's, Adam's beta_1) "
                             "goes for a compressor that Horovod's wrapper would take it from: the optimizer "
                             "keeps it (a user who changed nothing), or the compressor is given it "
                             "and the optimizer none (what docs/ddp.md tells a DDP user)")
    parser.add_argument("--init", choices=("default", "glorot"), default="default",
                        help="PyTorch's runs of mnist, the LSTM and words: glorot starts from Keras's "
                             "initial weights (compare_worker.py --init); a set-up of its own, "
                             "labelled [Keras init], outside the safety table")
    parser.add_argument("--loop", choices=("step", "fit", "tape"), default="step",
                        help="TensorFlow's runs: step, the benchmark's tf.function step handing the "
                             "gradients to the Keras optimizer as model.fit does; fit, model.fit "
                             "itself; tape, every compression through Horovod's DistributedGradientTape "
                             "(compare_worker.py --loop). fit and tape are set-ups of their own, "
                             "labelled [model.fit] and [tape], outside the safety table")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per run, of the workload's steps each (default: BUDGET's, 10); "
                             "more to follow a case further towards its plateau")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds (initial weights and data order), each set-up "
                             "run once per seed; the tables and plots show seed 0, and a table of "
                             "the gaps across seeds is added")
    parser.add_argument("--out", default=os.path.join(compare.ROOT, "out", "quality"))
    parser.add_argument("--from-json", nargs="+", metavar="FILE",
                        help="no runs: tables and plot from earlier quality.json files (of runs of "
                             "the same set-up, the one finished last by its recorded date)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.from_json:
        runs = []
        for path in args.from_json:
            with open(path) as f:
                runs.append(json.load(f))
        return write(merge(runs), args.out)
    import grace

    if args.compressors is None:
        args.compressors = ",".join(["fp32"] + grace.available())
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    for case in compare.split(args.cases):
        if case not in CASES:
            parser.error(f"--cases: {case!r} is not one of {', '.join(CASES)}")
    try:
        args.frameworks = ",".join(compare.engine_frameworks(args.frameworks, args.engines))
    except ValueError as e:
        parser.error(str(e))
    try:
        for c in compare.split(args.compressors):
            compare.parse_compression(c)
    except ValueError as e:
        parser.error(str(e))
    started = time.time()
    results = run_matrix(args)
    rows = write(results, args.out)
    print(f"\n{len(results)} runs in {time.time() - started:.0f} s. Results: {args.out}/quality.md, "
          f"quality.json, quality_summary.json, quality_*.png")
    return rows


if __name__ == "__main__":
    main()
