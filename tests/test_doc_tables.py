"""The docs' measured tables against their data (issue 44 item 6, issue 47 item 11): every
generated block and every tool output kept under docs/ is what scripts/doc_tables.py makes of its
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
    assert names.count(("docs/results.md", "compare.end_to_end")) == 4
    assert names.count(("docs/ddp.md", "quality.ddp")) == 2
    assert ("docs/catalogue.md", "quality.safety") in names
    assert ("docs/results.md", "time_to_accuracy") in names
    assert len(BLOCKS) >= 16 and len(OUTPUTS) >= 56
    # two-bit's end-to-end and exchange rows beside their neighbours, from its own runs
    twobit = [b for b in BLOCKS if b.page == "docs/results.md" and b.name == "compare.summary"]
    assert [b.files for b in twobit] == [["docs/results/twobit/resnet50.json"],
                                         ["docs/results/twobit/exchange.json"]]
    assert all("| twobit |" in b.body for b in twobit)
    # the catalogue's safety table: a row for every compressor of the catalogue
    import grace

    (safety,) = [b for b in BLOCKS if b.name == "quality.safety"]
    assert len(safety.body.splitlines()) == 2 + len(grace.available())


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.page}:{b.name}:{b.files[0]}")
def test_each_generated_table_is_what_its_runs_give(block):
    assert block.made() == block.body, f"python -m scripts.doc_tables rewrites {block.page}"


@pytest.mark.parametrize("path", sorted(OUTPUTS))
def test_each_tool_output_kept_in_the_docs_is_what_its_runs_give(path):
    table, files = OUTPUTS[path]
    with open(os.path.join(ROOT, path)) as f:
        assert f.read() == doc_tables.output_text(path, table, files)


def test_the_throughput_tables_are_medians_of_three_repeats():
    """Every figure of an end-to-end or DDP throughput table is a median of at least three repeats
    of a run that finished (a single noisy run is not a figure to print)."""
    for block in BLOCKS:
        if block.name.startswith("compare.") and block.page in ("docs/results.md", "docs/ddp.md"):
            for row in compare.medians(compare.read_runs(doc_tables.expand(block.files))):
                assert row["status"] == "ok" and len(row["repeats"]) >= 3, (block.page, row["compression"])


@pytest.mark.parametrize("page", doc_tables.top_pages())
def test_every_other_table_says_why_it_is_written_by_hand(page):
    """A table outside the generated blocks has a ``<!-- by hand: ... -->`` line: that it is not a
    measurement, or where its figures come from; a run file it names exists."""
    for line, why in doc_tables.hand_tables(page):
        assert why, f"{page}:{line}: a table neither generated nor said to be by hand"
        for named in doc_tables.NAMED_FILE.findall(why):
            assert glob.glob(os.path.join(ROOT, named)), f"{page}:{line}: {named} does not exist"


def test_a_changed_figure_or_run_fails_the_check_and_the_generator_mends_it(tmp_path, monkeypatch):
    """The check is not blind: a figure typed over a generated table, or a run file changed under
    it, is reported; the generator then writes the page back to what its data give."""
    docs = tmp_path / "docs"
    shutil.copytree(os.path.join(ROOT, "docs"), docs)
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
    runs = docs / "results" / "twobit" / "exchange.json"
    data = json.loads(runs.read_text())
    for run in data:
        run["step_s"] *= 2
    runs.write_text(json.dumps(data))
    assert [d.splitlines()[0] for d in doc_tables.differences()] == [
        "--- docs/results.md: compare.summary docs/results/twobit/exchange.json"]
    assert doc_tables.main(["--check"]) == 1
