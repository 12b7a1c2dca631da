"""The generated blocks of the docs: tables a tool made from recorded runs, which tests rebuild."""

from __future__ import annotations

import os

from tests.launch import ROOT


def generated_blocks(page: str, tool: str) -> list[tuple[list[str], str]]:
    """Each ``<!-- generated: TOOL FILE... -->`` block of a docs page: (its files, its text)."""
    text = open(os.path.join(ROOT, "docs", page)).read()
    blocks, start = [], 0
    marker = f"<!-- generated: {tool} "
    while (start := text.find(marker, start)) >= 0:
        files = text[start + len(marker):text.index(" -->", start)].split()
        end = text.index("<!-- end generated -->", start)
        assert "<!-- generated:" not in text[start + 1:end], "a generated block without its end"
        body = text[text.index("\n", start) + 1:end]
        blocks.append(([os.path.join(ROOT, f) for f in files], body.strip()))
        start += len(marker)
    return blocks
