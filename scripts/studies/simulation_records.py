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

NOT_THE_SETUP = ("seed", "accuracy", "note")
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


def markdown(record: dict) -> str:
    """The record's runs as a table: a row per set-up, a column per seed, and the mean of the seeds
    where a set-up ran more than one."""
    runs = record["runs"]
    keys = {key for run in runs for key in run if key not in NOT_THE_SETUP and key not in NAMES}
    varying = {key for key in keys if len({repr(run.get(key)) for run in runs}) > 1}
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
