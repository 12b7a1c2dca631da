"""The end-to-end targets (ResNet-50 on 2 emulated hosts, docs/results.md), judged from compare.py's
recorded runs rather than typed beside them.

Each target is a rule over the rows of ``compare.py --alone`` runs: a share of one worker alone
that some compressions must reach at one link rate, or img/s per worker at least another
compression's (less a slack) in the same run. The rows come from several results.json files, in
order: each file's ratios are taken against its own one-worker-alone run (a ratio is measured in
one run), and a later file's row of the same framework, rate and compression replaces an earlier
one's (``compare.read_runs``'s rule), so a target is judged on the latest measurement of each row.

    <!-- generated: end_to_end.targets data/results/end-to-end/results.json ... -->
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from scripts import compare

FRAMEWORK_NAMES = compare.FRAMEWORK_NAMES


@dataclass(frozen=True)
class Measured:
    """One row's figures: img/s per worker and its share of one worker alone (of its own run),
    and the img/s per worker of every compression of the same framework and rate in that run
    (``peers``: a comparison between two compressions is within one run)."""

    per_worker: float
    of_alone: float
    peers: dict = field(default_factory=dict, compare=False)


Rows = dict[tuple[str, str, str], Measured]  # (framework, rate, compression label) -> figures
Judged = tuple[str, str, bool]  # (framework, compression label, whether it meets the target)


@dataclass(frozen=True)
class OfAlone:
    """Each of ``compressions`` at ``rate`` reaches ``at_least`` of one worker alone."""

    rate: str
    compressions: tuple[str, ...]
    at_least: float

    def text(self) -> str:
        return f"{self.rate}: {', '.join(self.compressions)} ≥ {self.at_least:.2f} of one alone"

    def judge(self, rows: Rows, frameworks: list[str]) -> tuple[str, list[Judged]]:
        parts, judged = [], []
        for fw in frameworks:
            found = [(c, rows.get((fw, self.rate, c))) for c in self.compressions]
            cells = [f"{m.of_alone:.2f}" if m else "–" for _, m in found]
            parts.append(f"{FRAMEWORK_NAMES.get(fw, fw)} {', '.join(cells)}")
            judged += [(fw, c, m is not None and m.of_alone >= self.at_least) for c, m in found]
        return "; ".join(parts), judged


@dataclass(frozen=True)
class AtLeast:
    """Each of ``compressions`` at ``rate`` gives at least ``1 - slack`` of ``than``'s img/s per
    worker; ``compressions`` empty: every compression of that rate but ``than`` and ``besides``."""

    rate: str
    compressions: tuple[str, ...]
    than: str
    slack: float = 0.0
    besides: tuple[str, ...] = ()

    def text(self) -> str:
        who = ", ".join(self.compressions) or "every compression"
        within = f"within {self.slack:.0%} of" if self.slack else "at least"
        return f"{self.rate}: {who} {within} {self.than}"

    def judge(self, rows: Rows, frameworks: list[str]) -> tuple[str, list[Judged]]:
        parts, judged = [], []
        for fw in frameworks:
            name = FRAMEWORK_NAMES.get(fw, fw)
            names = self.compressions or tuple(
                c for (f, r, c) in rows if f == fw and r == self.rate
                and c not in (self.than, *self.besides))
            found = [(c, rows.get((fw, self.rate, c))) for c in names]
            # each against ``than`` of its own run: the latest row of each may be of two runs
            thans = [None if m is None else m.peers.get(self.than) for _, m in found]
            if not found or all(t is None for t in thans):
                parts.append(f"{name}: no {self.than} run beside them")
                judged += [(fw, c, False) for c in names] or [(fw, self.than, False)]
                continue
            cells = ", ".join(f"{c} {m.per_worker:.1f}" if m else f"{c} –" for c, m in found)
            against = sorted({f"{t:.1f}" for t in thans if t is not None})
            parts.append(f"{name}: {cells} against {' / '.join(against)}")
            judged += [(fw, c, m is not None and t is not None and m.per_worker >= (1 - self.slack) * t)
                       for (c, m), t in zip(found, thans)]
        return "; ".join(parts), judged


Target = OfAlone | AtLeast

WORKLOAD = "resnet50"
"""The workload the targets are of; a run's other workloads (the exchange alone) are not judged."""

ENGINES_JUDGED = ("torch", "tf")
"""The frameworks the targets are of: Horovod's, in PyTorch and TensorFlow. A run that also holds
DDP's rows (``compare.py --engines horovod,ddp``) gives its Horovod rows; DDP's own targets are
those of docs/ddp.md."""

# The targets of issue 43 (2 emulated hosts, ResNet-50, one core per worker), in its words.
TARGETS: tuple[Target, ...] = (
    OfAlone("1gbit", ("topk(ratio=0.01)", "dgc", "powersgd(rank=2)"), 0.90),
    OfAlone("1gbit", ("qsgd", "randomk(ratio=0.01)", "efsignsgd"), 0.85),
    OfAlone("100mbit", ("topk(ratio=0.01)", "dgc", "powersgd(rank=2)"), 0.85),
    AtLeast("1gbit", ("fp16", "bf16"), than="hvd-fp16"),
    AtLeast("1gbit", ("none",), than="fp32", slack=0.03),
    AtLeast("unshaped", (), than="fp32", besides=("hvd-fp16",)),
)


def rows_of(runs_by_file: Sequence[list[dict]]) -> tuple[Rows, list[str]]:
    """Every file's rows (medians of its repeats), each ratio against its own file's one worker
    alone, a later file's row replacing an earlier one's; and the frameworks, in order met."""
    rows: Rows = {}
    frameworks: list[str] = []
    for runs in runs_by_file:
        medians = compare.medians(runs)
        limits = compare.alone_limits(medians)
        found = [r for r in medians if r["rate"] != compare.ALONE and r["status"] == "ok"
                 and r["workload"] == WORKLOAD and r["framework"] in ENGINES_JUDGED
                 and (r["workload"], r["framework"]) in limits]
        for r in found:
            per = r["samples_per_s"] / r["workers"]
            peers = {compare.label(p["compression"]): p["samples_per_s"] / p["workers"] for p in found
                     if (p["framework"], p["rate"]) == (r["framework"], r["rate"])}
            rows[(r["framework"], r["rate"], compare.label(r["compression"]))] = Measured(
                per_worker=per, of_alone=per / limits[(r["workload"], r["framework"])], peers=peers)
            if r["framework"] not in frameworks:
                frameworks.append(r["framework"])
    return rows, frameworks


def verdict(judged: list[Judged]) -> str:
    """``yes``; ``no`` where every judged row misses (or nothing was measured); else ``no:`` and
    what misses, by framework."""
    missed = [(fw, c) for fw, c, ok in judged if not ok]
    if not judged:
        return "no"
    if not missed:
        return "yes"
    if len(missed) == len(judged):
        return "no"
    by_fw: dict[str, list[str]] = {}
    for fw, c in missed:
        by_fw.setdefault(FRAMEWORK_NAMES.get(fw, fw), []).append(c)
    return "no: " + "; ".join(f"{fw} {', '.join(cs)}" for fw, cs in by_fw.items())


def markdown(runs_by_file: Sequence[list[dict]], targets: Sequence[Target] = TARGETS) -> str:
    """A row per target: what it asks, what was measured (per framework), and whether it is met,
    naming what misses it."""
    rows, frameworks = rows_of(runs_by_file)
    lines = ["| target | measured | met |", "|---|---|---|"]
    for target in targets:
        measured, judged = target.judge(rows, frameworks)
        lines.append(f"| {target.text()} | {measured} | {verdict(judged)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="compare.py results.json files, earliest first")
    args = parser.parse_args(argv)
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append(json.load(f))
    print(markdown(runs))


if __name__ == "__main__":
    main()
