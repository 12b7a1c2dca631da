"""A simulation study's record as a table: the runs of ``simulate_mnist.py`` a study kept in one
JSON file (``{"what": ..., "command": ..., "runs": [{..., "seed": S, "accuracy": [...]}, ...]}``),
one row per set-up, the final test accuracy per seed, and their mean where a set-up ran several.

A set-up is everything a run records but its seed, its accuracies and a note: the spec (or the
study's own name for the variant) first, then each setting that differs between the record's runs
(a setting every run shares is the study's, said in its ``what``; one the variant's own words
already name is not repeated). Rows keep the record's order."""

from __future__ import annotations

import re
from typing import Any

from scripts import compare

NOT_THE_SETUP = ("seed", "accuracy", "note", "owner_entries_vs_fixed_k")
"""What a run records that is not its set-up: its seed, what it measured, a note."""
NAMES = ("spec", "variant")  # the set-up's own name, written first


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def setup_of(run: dict, varying: set[str]) -> str:
    """The set-up's words: its name, then each varying setting (``lr 0.003``, a flag by its name)."""
    words = [str(run[key]) for key in NAMES if run.get(key) is not None]
    named = run.get("variant", "")
    for key, value in run.items():
        if key in NAMES or key in NOT_THE_SETUP or key not in varying or value in (None, False):
            continue
        if re.search(rf"\b{re.escape(key.replace('_', ' '))}\b", named):  # its words say it already
            continue
        words.append(key.replace("_", " ") if value is True else f"{key.replace('_', ' ')} {_value(value)}")
    return ", ".join(words)


def varying_settings(runs: list[dict]) -> set[str]:
    """The settings (beyond the set-up's name) whose values differ between the record's runs."""
    keys = {key for run in runs for key in run if key not in NOT_THE_SETUP and key not in NAMES}
    return {key for key in keys if len({repr(run.get(key)) for run in runs}) > 1}


def markdown(record: dict) -> str:
    """The record's runs as a table: a row per set-up, a column per seed, and the mean of the seeds
    where a set-up ran more than one."""
    runs = record["runs"]
    varying = varying_settings(runs)
    finals: dict[str, dict[int, float]] = {}
    for run in runs:
        setup, seed = setup_of(run, varying), run.get("seed", 0)
        by_seed = finals.setdefault(setup, {})
        if seed in by_seed:  # two runs the table could not tell apart
            raise ValueError(f"two runs of {setup!r} at seed {seed} in the record")
        by_seed[seed] = run["accuracy"][-1]
    seeds = sorted({seed for by_seed in finals.values() for seed in by_seed})
    several = any(len(by_seed) > 1 for by_seed in finals.values())
    passes = sorted({len(run["accuracy"]) for run in runs})
    after = (f"after {passes[0]} pass{'es' if passes[0] != 1 else ''}" if len(passes) == 1
             else f"after {'/'.join(map(str, passes))} passes, as each set-up ran")
    lines = [f"| set-up (final test accuracy {after}) | "
             + " | ".join(f"seed {seed}" for seed in seeds) + (" | mean |" if several else " |"),
             "|---|" + "---:|" * (len(seeds) + several)]
    for setup, by_seed in finals.items():
        cells = [f"{by_seed[seed]:.4f}" if seed in by_seed else "" for seed in seeds]
        if several:
            mean = sum(by_seed.values()) / len(by_seed)
            cells.append(f"**{mean:.4f}**" if len(by_seed) > 1 else "")
        lines.append(f"| {setup.replace('|', '/')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


GATHERED = "allgather"
"""The communicator of the route the others are measured against."""


def _counterpart(run: dict) -> tuple | None:
    """What identifies the gathered run a run is measured against: the compressor, its parameters
    but the route's own (``communicator``, an owner's ``owner_*``), the workers and the seed; and
    whether the run is itself gathered. ``None`` for a run that names no communicator."""
    name, params = compare.spec_parts(run["spec"])
    if "communicator" not in params:
        return None
    kept = tuple(sorted((k, repr(v)) for k, v in params.items()
                        if k != "communicator" and not k.startswith("owner_")))
    return (name, kept, run.get("workers"), run.get("seed", 0)), params["communicator"] == GATHERED


def _final_and_last3(run: dict) -> tuple[float, float]:
    accuracy = run["accuracy"]
    return accuracy[-1], sum(accuracy[-3:]) / len(accuracy[-3:])


def against_gathering(record: dict) -> str:
    """The record's routes against gathering, in points: for each set-up that names a communicator
    other than ``allgather``, the difference of its final test accuracy (and, in brackets, of the
    mean of the last 3 passes) to the gathered run of the same compressor, parameters, workers and
    seed, per seed, and the mean over its seeds; the gathered runs' own finals in their rows."""
    runs = record["runs"]
    varying = varying_settings(runs)
    routed = [(run, *found) for run in runs if (found := _counterpart(run)) is not None]
    gathered: dict[tuple, dict] = {}
    for run, key, is_gathered in routed:
        if is_gathered and run.get("variant") is None:
            if key in gathered:
                raise ValueError(f"two gathered runs of {run['spec']!r} at seed {key[-1]} in the record")
            gathered[key] = run
    # set-up -> (whether it is the reference, {seed: its final, or (final, last 3) against it})
    rows: dict[str, tuple[bool, dict]] = {}
    for run, key, _ in routed:
        reference = gathered.get(key) is run
        by_seed = rows.setdefault(setup_of(run, varying), (reference, {}))[1]
        if reference:
            by_seed[key[-1]] = run["accuracy"][-1]
            continue
        if key not in gathered:
            raise ValueError(f"no gathered run beside {run['spec']!r} at seed {key[-1]} in the record")
        mine, theirs = _final_and_last3(run), _final_and_last3(gathered[key])
        by_seed[key[-1]] = (100 * (mine[0] - theirs[0]), 100 * (mine[1] - theirs[1]))
    seeds = sorted({seed for _, by_seed in rows.values() for seed in by_seed})
    lines = ["| set-up, against gathering at the same seed: final (last 3 passes), points | "
             + " | ".join(f"seed {seed}" for seed in seeds) + " | mean |",
             "|---|" + "---:|" * (len(seeds) + 1)]
    for setup, (reference, by_seed) in rows.items():
        name = setup.replace("|", "/")
        if reference:
            cells = [f"{by_seed[s]:.4f}" if s in by_seed else "" for s in seeds]
            lines.append(f"| {name} (final accuracy) | " + " | ".join(cells) + " | – |")
            continue
        cells = [f"{by_seed[s][0]:+.2f} ({by_seed[s][1]:+.2f})" if s in by_seed else "" for s in seeds]
        values = list(by_seed.values())
        mean = (sum(v[0] for v in values) / len(values), sum(v[1] for v in values) / len(values))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | **{mean[0]:+.2f}** ({mean[1]:+.2f}) |")
    return "\n".join(lines)
