"""Every table of the docs that reports measured figures, made again from its recorded runs: the
one generator of those tables.

A page marks such a table, in README.md, any page under docs/ or any page kept with its runs
under data/:

    <!-- generated: NAME FILE... -->
    | the table ... |
    <!-- end generated -->

NAME is one of ``TABLES`` (which tool's table, from which kind of run file); each FILE is a path
from the repository's root, or a glob of them. The text between the markers is exactly what the
table's function makes of those files. A tool's whole output file kept under data/ beside its
runs (``outputs``) is checked the same way.

    .venv/bin/python -m scripts.doc_tables            # rewrite every block from its files
    .venv/bin/python -m scripts.doc_tables --check    # say which block differs from its data; exit 1

``tests/test_doc_tables.py`` runs the check, so a table typed by hand, or left behind when its
runs were replaced, fails the suite. Tables that report no run (definitions, targets, settings)
are written by hand; a measured table that is not generated says why in a ``<!-- by hand: ... -->``
line above it, and that test holds the list.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from scripts import compare, end_to_end_targets, quality
from scripts import time_to_accuracy as tta
from scripts.studies import convergence_bars, simulation_records
from scripts.tools import bench_compressors, bench_ddp_hooks, cost_model, ddp_hook_time, plot_routes

ROOT = compare.ROOT
RUNS = "data"  # the recorded runs, one folder per study, with what the tools made of them
BLOCK = re.compile(r"<!-- generated: (?P<name>\S+) (?P<files>[^>]*?) -->\n(?P<body>.*?)"
                   r"<!-- end generated -->", re.S)


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def _each_json(paths: list[str]) -> list[tuple[str, object]]:
    """(path, its contents) of every file, for the tables that keep each file's runs apart."""
    return [(path, _json(path)) for path in paths]


def _quality_rows(paths: list[str]) -> list[dict]:
    """quality.py's rows of the runs: the latest run of each set-up (``merge``), summarized."""
    return quality.summarize(quality.merge([_json(p) for p in paths]))


def _catalogue(table: Callable[[list[dict], list[str]], str]) -> Callable[[list[str]], str]:
    """A quality.py table of a row per compressor of the catalogue (at its defaults), from runs."""
    def make(paths: list[str]) -> str:
        import grace

        return table(_quality_rows(paths), grace.available())

    return make


def _validated(paths: list[str]) -> list[dict]:
    """The cost model set against the runs (``cost_model --validate``), with make bench's codecs."""
    return cost_model.validate(paths, cost_model.codecs())


def _compare_rows(paths: list[str]) -> list[dict]:
    """compare.py's rows of the runs: the median of each set-up's repeats."""
    return compare.medians(compare.read_runs(paths))


def _matrix(paths: list[str]) -> str:
    rows = _compare_rows(paths)
    limits = compare.alone_limits(rows)
    return compare.markdown([compare.flatten(r, limits) for r in rows])


@dataclass(frozen=True)
class Table:
    """One kind of generated table: what makes its text from its files, and what its files are."""

    make: Callable[[list[str]], str]
    files: str

    def text(self, paths: list[str]) -> str:
        return self.make(paths).strip()


TABLES: dict[str, Table] = {
    "compare.summary": Table(lambda p: compare.summary_markdown(_compare_rows(p)),
                             "compare.py's results.json: the end-to-end table where one worker "
                             "alone ran, else step times against fp32"),
    "compare.end_to_end": Table(lambda p: compare.end_to_end_markdown(_compare_rows(p)),
                                "compare.py's results.json with --alone"),
    "compare.bytes": Table(lambda p: compare.bytes_markdown(_each_json(p)),
                           "compare.py's results.json files: bytes on a worker's link against the "
                           "number of workers"),
    "compare.runs": Table(lambda p: compare.runs_markdown(_each_json(p)),
                          "several compare.py results.json files of one matrix: each run's "
                          "ratios to its own fp32, side by side"),
    "compare.matrix": Table(_matrix, "compare.py's results.json: every column of every set-up"),
    **{f"compare.by_rate.{workload}": Table(
        lambda p, workload=workload: compare.by_rate_markdown(_compare_rows(p), workload),
        f"compare.py's results.json: the {workload} workload's set-ups against the link rate")
       for workload in ("mnist", "exchange")},
    "cost_model.link": Table(lambda p: cost_model.link_and_step_table(_validated(p)),
                             "compare.py results.json files of the exchange workload: each timed "
                             "run against the cost model (make bench's codecs), bytes and step"),
    "cost_model.host": Table(lambda p: cost_model.host_error_table(_validated(p)),
                             "compare.py results.json files of the exchange workload, timed and "
                             "unshaped: the model's step error with the host's share, run by run"),
    "end_to_end.targets": Table(lambda p: end_to_end_targets.markdown([_json(f) for f in p]),
                                "compare.py --alone results.json files, earliest first: the "
                                "end-to-end targets, each judged on the latest row"),
    "quality.main": Table(lambda p: quality.markdown(_quality_rows(p)),
                          "quality.py's run files: final metric and gap to fp32, seed 0"),
    "quality.seeds": Table(lambda p: quality.seeds_markdown(_quality_rows(p)),
                           "quality.py's run files of several seeds: each seed's gap, mean, spread"),
    "quality.ddp": Table(lambda p: quality.ddp_markdown(_quality_rows(p)),
                         "quality.py's run files of --engines ddp beside Horovod's"),
    "quality.followed": Table(lambda p: quality.followed_markdown(_quality_rows(p)),
                              "quality.py's run files of --epochs above the benchmark's: gaps at "
                              "its length and at the end"),
    "quality.safety": Table(_catalogue(quality.safety_markdown),
                            "quality.py's run files: a row per compressor of the catalogue, a cell "
                            "per case and framework"),
    "quality.gaps": Table(_catalogue(quality.gaps_markdown),
                          "quality.py's run files: the safety table's figures, each compressor's "
                          "mean gap per case and framework"),
    "time_to_accuracy": Table(lambda p: tta.markdown(tta.summarize(compare.read_runs(p))),
                              "time_to_accuracy.py's results.json"),
    "ddp_hooks": Table(lambda p: bench_ddp_hooks.markdown(_json(*p)),
                       "one --json file of bench_ddp_hooks.py"),
    "ddp_hook_time": Table(lambda p: ddp_hook_time.markdown(_json(*p)),
                           "one --json file of ddp_hook_time.py"),
    "bench.resnet50": Table(lambda p: bench_compressors.case_markdown(_json(*p)["catalogue"], "resnet50"),
                            "make bench's --json file: PyTorch's ResNet-50 case against a copy"),
    "bench.sides": Table(lambda p: bench_compressors.sides_markdown(_json(*p)),
                         "one --json file of bench_compressors.py --before: two checkouts"),
    "convergence_bars": Table(lambda p: convergence_bars.markdown(convergence_bars.as_run(_json(*p))),
                              "the record of scripts/studies/convergence_bars.py: the convergence "
                              "test's bars"),
    "simulation": Table(lambda p: simulation_records.markdown(_json(*p)),
                        "a simulation study's record: runs of scripts/studies/simulate_mnist.py "
                        "kept in one JSON file"),
    "simulation.against_gathering": Table(
        lambda p: simulation_records.against_gathering(_json(*p)),
        "a simulation study's record of routes: each against gathering at the same seed"),
    "routes.seeds": Table(lambda p: plot_routes.seeds_table(plot_routes.seed_differences(
        [run for path in p for run in _json(path)])),
        "compare.py results.json files of one compressor by several routes and seeds: each route "
        "against the first at the same seed"),
    "ddp_hooks.compare": Table(lambda p: bench_ddp_hooks.comparison(*map(_json, p)),
                               "two --json files of bench_ddp_hooks.py: before, after"),
}

def _is_run_file(path: str) -> bool:
    """A file of runs (a list of them), not a summary or a note kept beside them."""
    with open(path) as f:
        return isinstance(json.load(f), list) and os.path.basename(path) not in SUMMARIES


# What the tools write of their rows beside the runs: a table's input is the runs, not these.
SUMMARIES = ("quality_summary.json", "time_to_accuracy.json")


def outputs() -> dict[str, tuple[str, list[str]]]:
    """The tools' own output files kept under data/ beside their runs, each what a table makes of
    them: path -> (table, files). quality.py's quality.md and safety.md of every run in
    data/quality/runs/; its quality.md in a folder of runs of its own; compare.py's results.md
    (or NAME.md beside NAME.json), end_to_end.md and time_to_accuracy.md; bench_ddp_hooks.py's
    tables beside their --json files."""
    found = {"data/quality/quality.md": ("quality.main", ["data/quality/runs/*.json"]),
             "data/quality/safety.md": ("quality.safety", ["data/quality/runs/*.json"]),
             "data/quality/lstm-12000-steps/quality.md": ("quality.main",
                                                          ["data/quality/runs/lstm-12000-steps.json"])}
    for path in sorted(glob.glob(os.path.join(ROOT, RUNS, "quality", "*", "**", "quality.md"),
                              recursive=True)):
        runs = [p for p in sorted(glob.glob(os.path.join(os.path.dirname(path), "*.json")))
                if _is_run_file(p)]
        if runs:
            found.setdefault(os.path.relpath(path, ROOT),
                             ("quality.main", [os.path.relpath(p, ROOT) for p in runs]))
    for path in sorted(glob.glob(os.path.join(ROOT, RUNS, "results", "**", "*.md"), recursive=True)):
        folder, name = os.path.split(path)
        own = path[:-3] + ".json"
        every = os.path.join(folder, "results.json")
        with open(path) as f:
            head = f.read(200)
        if name == "time_to_accuracy.md":
            table, files = "time_to_accuracy", [os.path.join(folder, f"{fw}.json") for fw in ("torch", "tf")]
        elif name.startswith("end_to_end"):
            table, files = "compare.end_to_end", [every if os.path.exists(every) else
                                                  os.path.join(folder, "tf.json" if name.endswith("_tf.md")
                                                               else "torch.json")]
        elif head.startswith("### ") and "| framework | compression |" in head:
            table, files = "compare.matrix", [own if os.path.exists(own) else every]
        elif head.startswith("ResNet-50,") and os.path.exists(own):
            table, files = "ddp_hooks", [own]
        else:
            continue
        found[os.path.relpath(path, ROOT)] = (table, [os.path.relpath(p, ROOT) for p in files])
    return found


def pages() -> list[str]:
    """README.md, every page under docs/ and every page kept with runs under data/, from the root."""
    found = ["README.md"] + sorted(os.path.relpath(p, ROOT) for folder in ("docs", RUNS) for p in
                                   glob.glob(os.path.join(ROOT, folder, "**", "*.md"), recursive=True))
    made = outputs()
    return [p for p in found if p not in made]


def expand(patterns: list[str]) -> list[str]:
    """The files a block names, globs expanded in sorted order; a pattern that names nothing fails."""
    paths = []
    for pattern in patterns:
        found = sorted(glob.glob(os.path.join(ROOT, pattern)))
        if not found:
            raise FileNotFoundError(f"{pattern}: no such run file")
        paths += found
    return paths


@dataclass(frozen=True)
class Block:
    page: str
    name: str
    files: list[str]
    body: str
    span: tuple[int, int]  # of the body in the page's text

    def made(self) -> str:
        if self.name not in TABLES:
            raise KeyError(f"{self.page}: generated table {self.name!r} is not one of "
                           f"{', '.join(TABLES)}")
        return TABLES[self.name].text(expand(self.files))


def blocks(page: str) -> list[Block]:
    """The generated blocks of one page (a path from the root)."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    found = [Block(page, m["name"], m["files"].split(), m["body"].strip(), m.span("body"))
             for m in BLOCK.finditer(text)]
    if text.count("<!-- generated: ") != len(found) or text.count("<!-- end generated -->") != len(found):
        raise ValueError(f"{page}: a generated block without its end, or an end without its start")
    return found


BY_HAND = re.compile(r"<!-- by hand: (?P<why>.+?) -->")
NAMED_FILE = re.compile(r"[\w./*-]+\.(?:json|md|csv|txt|png)\b")


def named_files_exist(why: str) -> list[str]:
    """The files a by-hand reason names (a path from the root) that do not exist."""
    return [named for named in NAMED_FILE.findall(why)
            if not glob.glob(os.path.join(ROOT, named))]


def top_pages() -> list[str]:
    """The pages a reader reads: README.md and docs/*.md (the runs and the tools' outputs are under
    data/)."""
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                  if f.endswith(".md"))


def hand_tables(page: str) -> list[tuple[int, str | None]]:
    """Each table of the page outside the generated blocks: (its first line's number, the reason its
    ``<!-- by hand: ... -->`` line gives, or None where it has none)."""
    with open(os.path.join(ROOT, page)) as f:
        text = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), f.read())
    lines = [line.strip() for line in text.split("\n")]  # a table in a list item is indented
    found = []
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            note = BY_HAND.fullmatch(lines[i - 1]) if i else None
            found.append((i + 1, note["why"].strip() or None if note else None))
    return found


def every_block() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def output_text(path: str, table: str, files: list[str]) -> str:
    """What an output file holds when made again from its runs."""
    return TABLES[table].text(expand(files)) + "\n"


def rewrite(page: str) -> bool:
    """Every block of the page made again from its files; True where the page changed."""
    path = os.path.join(ROOT, page)
    with open(path) as f:
        text = f.read()
    new = text
    for block in reversed(blocks(page)):
        start, end = block.span
        new = new[:start] + block.made() + "\n" + new[end:]
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


def differences() -> list[str]:
    """A unified diff per block or output file whose text is not what its data give."""
    out = []
    for block in every_block():
        made = block.made()
        if made != block.body:
            out.append("".join(difflib.unified_diff(
                (block.body + "\n").splitlines(True), (made + "\n").splitlines(True),
                f"{block.page}: {block.name} {' '.join(block.files)}", "made from the files")))
    for path, (table, files) in outputs().items():
        with open(os.path.join(ROOT, path)) as f:
            kept = f.read()
        made = output_text(path, table, files)
        if made != kept:
            out.append("".join(difflib.unified_diff(kept.splitlines(True), made.splitlines(True),
                                                    path, "made from the files")))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="change nothing: print each table that differs from its data, exit 1")
    parser.add_argument("--list", action="store_true", help="the kinds of table and their files")
    args = parser.parse_args(argv)
    if args.list:
        for name, table in TABLES.items():
            print(f"{name}: {table.files}")
        return 0
    if args.check:
        found = differences()
        print("\n".join(found) if found else f"{len(every_block())} tables and {len(outputs())} "
                                             "output files are what their data give")
        return 1 if found else 0
    changed = [page for page in pages() if rewrite(page)]
    for path, (table, files) in outputs().items():
        made = output_text(path, table, files)
        with open(os.path.join(ROOT, path)) as f:
            if f.read() == made:
                continue
        with open(os.path.join(ROOT, path), "w") as f:
            f.write(made)
        changed.append(path)
    print("rewrote: " + (", ".join(changed) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
