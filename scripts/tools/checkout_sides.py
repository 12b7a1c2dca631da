"""One side of a comparison of two checkouts (scripts/tools/pipeline_digests.py, pipeline_overhead.py):
the comparing script runs itself again with ``--measure ROOT`` in a process that imports grace
from that checkout, and reads back the JSON the run prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from scripts import ROOT


def measure_side(script: str, root: str, *args: str) -> dict:
    """``script --measure root *args`` in a process whose working folder is the checkout at
    ``root`` and whose ``PYTHONPATH`` names it first; its last line of output, parsed. A failing
    side raises."""
    root = os.path.abspath(root)
    # The checkout's grace first; this checkout's scripts after it, for a checkout from before
    # scripts/ was a package (whose scripts/ folder then holds no tools/).
    path = os.pathsep.join([root, ROOT])
    result = subprocess.run([sys.executable, os.path.abspath(script), "--measure", root, *args],
                            capture_output=True, text=True, check=True, cwd=root,
                            env=dict(os.environ, PYTHONPATH=path))
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_imported_from(root: str) -> None:
    """The grace this process imported is the checkout's at ``root``, not another on the path
    (a comparison of a checkout with itself would find nothing)."""
    import grace

    where = os.path.dirname(os.path.dirname(os.path.abspath(grace.__file__)))
    assert where == os.path.abspath(root), f"grace was imported from {where}, not {root}"


def take_turns(script: str, before: str, after: str, repeats: int, *args: str) -> dict[str, list]:
    """``measure_side`` of ``script`` with ``args`` through the checkouts ``before`` and ``after``,
    in turns, ``repeats`` times each (a progress bar counts them): each side's results in order,
    so that result i of one side was measured beside result i of the other."""
    from tqdm import tqdm

    runs: dict[str, list] = {"before": [], "after": []}
    with tqdm(total=2 * repeats, desc="checkouts") as bar:
        for _ in range(repeats):
            for side, root in (("before", before), ("after", after)):
                runs[side].append(measure_side(script, root, *args))
                bar.update()
    return runs
