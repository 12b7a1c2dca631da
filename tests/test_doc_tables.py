"""The docs' measured tables against their data (issue 44 item 6, issue 47 item 11): every
generated block and every tool output kept under data/ is what scripts/doc_tables.py makes of its
run files, and every other table says why it is written by hand."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from scripts import compare, doc_tables
from tests.launch import ROOT

BLOCKS = doc_tables.every_block()
OUTPUTS = doc_tables.outputs()


def test_the_docs_have_their_generated_tables():
    """The pages hold the blocks this suite checks: the end-to-end tables of results.md, the DDP
    tables, the time to accuracy, the catalogue's safety table (a lost marker would drop a table
    from the check silently)."""
    names = [(b.page, b.name) for b in BLOCKS]
    # the end-to-end tables: 1 Gbit/s and 100 Mbit/s, TensorFlow mended, the unshaped link, the
    # 16-bit rows of both frameworks
    assert names.count(("docs/results.md", "compare.end_to_end")) == 6
    # the owners' route studies: the simulation, and the real runs' routes seed by seed
    assert ("docs/results.md", "simulation.against_gathering") in names
    assert names.count(("docs/results.md", "routes.seeds")) == 2
    # the accuracy tables: the first machine's matrix, the momentum given, two-bit's seeds
    assert names.count(("docs/ddp.md", "quality.ddp")) == 3
    assert ("docs/catalogue.md", "quality.safety") in names
    assert ("docs/results.md", "time_to_accuracy") in names
    assert ("docs/results.md", "end_to_end.targets") in names  # issue 43's targets, judged
    assert len(BLOCKS) >= 16 and len(OUTPUTS) >= 56
    # two-bit's end-to-end and exchange rows beside their neighbours, from its own runs; the other
    # compare.py tables of results.md are the owners' and the hierarchy's single runs (SINGLE_RUNS)
    summaries = [b.files for b in BLOCKS if b.page == "docs/results.md" and b.name == "compare.summary"]
    assert summaries == [["data/results/twobit/resnet50.json"], ["data/results/twobit/exchange.json"],
                         ["data/results/alltoall/exchange-1gbit.json"],
                         ["data/results/model/exchange-owners-2k.json"],
                         ["data/results/model/exchange-onebit-2passes.json"],
                         ["data/results/alltoall/hierarchical-bytes.json"],
                         ["data/results/alltoall/hierarchical-before.json"]]
    twobit = [b for b in BLOCKS if b.files[0].startswith("data/results/twobit/")]
    assert len(twobit) == 2 and all("| twobit |" in b.body for b in twobit)
    # the catalogue's safety table: a row for every compressor of the catalogue
    import grace

    (safety,) = [b for b in BLOCKS if b.name == "quality.safety"]
    assert len(safety.body.splitlines()) == 2 + len(grace.available())


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.page}:{b.name}:{b.files[0]}")
def test_each_generated_table_is_what_its_runs_give(block):
    assert block.made() == block.body, f"python -m scripts.doc_tables rewrites {block.page}"


@pytest.mark.parametrize("path", sorted(OUTPUTS))
def test_each_tool_output_kept_with_its_runs_is_what_its_runs_give(path):
    table, files = OUTPUTS[path]
    with open(os.path.join(ROOT, path)) as f:
        assert f.read() == doc_tables.output_text(path, table, files)


SINGLE_RUNS = {
    # bytes on a link per step: exact in any one run (compare.bytes), not a timing to take a median of
    *(f"data/results/alltoall/{name}.json" for name in (
        "exchange-bytes", "exchange-bytes-owners-2k", "exchange-bytes-onebit-2passes",
        "mlp-bytes", "mlp-bytes-owners-2k", "mlp-bytes-onebit-2passes")),
    # the owners' and the hierarchy's step times at 2 and 4 workers, one run each
    "data/results/alltoall/exchange-1gbit.json", "data/results/alltoall/hierarchical-bytes.json",
    "data/results/alltoall/hierarchical-before.json", "data/results/model/exchange-owners-2k.json",
    "data/results/model/exchange-onebit-2passes.json",
}
"""The run files of results.md's compare.py tables that are single runs. exchange-studies.md is the
page of the single runs earlier work was measured by, each ratio within its own run."""


def held_to_three_repeats(block) -> bool:
    """A compare.py table of results.md or ddp.md, other than the single runs of ``SINGLE_RUNS``."""
    return (block.name.startswith("compare.") and block.page in ("docs/results.md", "docs/ddp.md")
            and not set(doc_tables.expand(block.files)) <= {os.path.join(ROOT, f) for f in SINGLE_RUNS})


def test_the_throughput_tables_are_medians_of_three_repeats():
    """Every figure of an end-to-end or DDP throughput table is a median of at least three repeats
    of a run that finished (a single noisy run is not a figure to print)."""
    exempt = {f for b in BLOCKS if b.page == "docs/results.md" and not held_to_three_repeats(b)
              and b.name.startswith("compare.") for f in b.files}
    assert exempt == SINGLE_RUNS  # every exemption used, and none more
    assert sum(map(held_to_three_repeats, BLOCKS)) == 13  # 6 end-to-end, 2 two-bit, 5 of DDP
    for block in BLOCKS:
        if held_to_three_repeats(block):
            for row in compare.medians(compare.read_runs(doc_tables.expand(block.files))):
                assert row["status"] == "ok" and len(row["repeats"]) >= 3, (block.page, row["compression"])


@pytest.mark.parametrize("page", doc_tables.top_pages())
def test_every_other_table_says_why_it_is_written_by_hand(page):
    """A table outside the generated blocks has a ``<!-- by hand: ... -->`` line: that it is not a
    measurement, or where its figures come from; a run file it names exists."""
    for line, why in doc_tables.hand_tables(page):
        assert why, f"{page}:{line}: a table neither generated nor said to be by hand"
        assert not doc_tables.named_files_exist(why), f"{page}:{line}: names a file that is not there"


def test_the_by_hand_rule_sees_every_table_and_takes_no_empty_or_wrong_reason(tmp_path, monkeypatch):
    """A table in a list item counts; a by-hand line excuses only the table right under it; a
    blank reason is none; a reason naming a file (a path from the root) that is not there is caught,
    whatever its extension, also a run's path as a page under docs/ once named it."""
    (tmp_path / "data" / "results").mkdir(parents=True)
    (tmp_path / "data" / "results" / "kept.json").write_text("[]")
    (tmp_path / "docs" / "results").mkdir(parents=True)  # where a page once named it from
    (tmp_path / "docs" / "results" / "kept.json").write_text("[]")
    (tmp_path / "docs" / "page.md").write_text("\n".join([
        "<!-- by hand: not a measurement: settings -->", "| a | b |", "|---|---|", "",
        "- in a list:", "", "  | c |", "  |---|", "",
        "<!-- by hand: from data/results/kept.json -->", "", "| d |", "|---|", "",
        "<!-- by hand:    -->", "| e |", "|---|", ""]))
    monkeypatch.setattr(doc_tables, "ROOT", str(tmp_path))
    assert doc_tables.hand_tables("docs/page.md") == [
        (2, "not a measurement: settings"), (7, None), (12, None), (16, None)]
    assert doc_tables.named_files_exist("from data/results/kept.json and data/results/k*.json") == []
    assert doc_tables.named_files_exist("from results/kept.json, data/x.csv and notes.txt") == [
        "results/kept.json", "data/x.csv", "notes.txt"]


@pytest.mark.parametrize("text, error", [
    ("<!-- generated: compare.summary docs/r.json -->\n| a |\n", ValueError),  # no end
    ("| a |\n<!-- end generated -->\n", ValueError),  # an end without its start
    ("<!-- generated: compare.summary -->\n| a |\n<!-- end generated -->\n", ValueError),  # no files
    ("<!-- generated: compare.summary docs/r.json -->\n<!-- generated: compare.summary docs/r.json -->"
     "\n| a |\n<!-- end generated -->\n<!-- end generated -->\n", ValueError),  # nested
    ("<!-- generated: compare.sumary docs/r.json -->\n| a |\n<!-- end generated -->\n", KeyError),
    ("<!-- generated: compare.summary docs/gone.json -->\n| a |\n<!-- end generated -->\n",
     FileNotFoundError),
])
def test_a_malformed_block_is_an_error_not_a_table_left_unchecked(tmp_path, monkeypatch, text, error):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(text)
    (tmp_path / "docs" / "r.json").write_text("[]")
    monkeypatch.setattr(doc_tables, "ROOT", str(tmp_path))
    with pytest.raises(error):
        for block in doc_tables.blocks("docs/page.md"):
            block.made()


def test_every_tool_output_beside_its_runs_is_checked_or_said_to_be_apart():
    """A page X.md kept beside its runs X.json under data/ is one of the checked outputs, or one
    whose tool cannot make it from that file (named here, with why)."""
    apart = {
        # make bench's stdout, tee'd; bench_compressors writes its JSON with fewer columns
        "data/performance/bench.md": "bench_compressors.py prints it; no --from-json",
        "data/results/cuda/bench_cuda.md": "the same, on a lent GPU",
        # cost_model.py writes model.json beside model.md: its output, made from make bench's JSON
        "data/results/alltoall/model.md": "cost_model.py --out, not from model.json",
        "data/results/model/model.md": "the same",
    }
    beside = {os.path.relpath(md, ROOT)
              for md in glob.glob(os.path.join(ROOT, "data", "**", "*.md"), recursive=True)
              if os.path.exists(md[:-3] + ".json")}
    assert beside - set(OUTPUTS) == set(apart)


def test_a_changed_figure_or_run_fails_the_check_and_the_generator_mends_it(tmp_path, monkeypatch):
    """The check is not blind: a figure typed over a generated table, or a run file changed under
    it, is reported; the generator then writes the page back to what its data give."""
    docs, recorded = tmp_path / "docs", tmp_path / "data"
    shutil.copytree(os.path.join(ROOT, "docs"), docs)
    shutil.copytree(os.path.join(ROOT, "data"), recorded)
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    monkeypatch.setattr(doc_tables, "ROOT", str(tmp_path))
    assert doc_tables.differences() == []
    page = docs / "results.md"
    text = page.read_text()
    block = next(b for b in doc_tables.blocks("docs/results.md") if b.name == "compare.end_to_end")
    typed = block.body.replace("| topk(ratio=0.01) | 41.1 |", "| topk(ratio=0.01) | 45.1 |", 1)
    assert typed != block.body
    page.write_text(text.replace(block.body, typed))
    (found,) = doc_tables.differences()
    assert "-| topk(ratio=0.01) | 45.1 |" in found and "+| topk(ratio=0.01) | 41.1 |" in found
    assert doc_tables.main([]) == 0 and page.read_text() == text
    runs = recorded / "results" / "twobit" / "exchange.json"
    data = json.loads(runs.read_text())
    for run in data:
        run["step_s"] *= 2
    runs.write_text(json.dumps(data))
    assert [d.splitlines()[0] for d in doc_tables.differences()] == [
        "--- docs/results.md: compare.summary data/results/twobit/exchange.json"]
    assert doc_tables.main(["--check"]) == 1
    assert doc_tables.main([]) == 0 and doc_tables.differences() == []  # the page follows its runs
    # an output file of a tool kept beside its runs: an edit is found, and undone
    output = recorded / "results" / "results.md"
    kept = output.read_text()
    output.write_text(kept + "| typed | by | hand |\n")
    assert [d.splitlines()[0] for d in doc_tables.differences()] == ["--- data/results/results.md"]
    assert doc_tables.main(["--check"]) == 1
    assert doc_tables.main([]) == 0 and output.read_text() == kept
