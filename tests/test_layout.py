"""The checkout's layout as the README states it: ``scripts`` and ``tests`` are packages that
import each other by module name (``from scripts import compare``), run from the checkout with
``python -m scripts.<name>``; no module edits the import path to find another; and every command
and script path the docs give names a module that exists."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

from tests.launch import ROOT

# The pages (docs/) and the pages kept with the recorded runs (data/), as the README says.
DOCS = ["README.md", "Makefile"] + [os.path.join(folder, name) for top in ("docs", "data")
                                    for folder, _, names in os.walk(os.path.join(ROOT, top))
                                    for name in names if name.endswith(".md")]


def tracked_python() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [path for path in out if os.path.exists(os.path.join(ROOT, path))]


def edits_the_path(tree: ast.AST) -> list[int]:
    """Lines that change ``sys.path`` (``sys.path.insert(...)``, ``.append``, ``.extend``,
    ``+=``, assignment, a slice of it assigned or deleted), import ``path`` from ``sys`` to do so,
    or add a site folder (``site.addsitedir``)."""
    def is_sys_path(node):
        if isinstance(node, ast.Subscript):
            node = node.value
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and (is_sys_path(node.func.value)
                     and node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear")
                     or node.func.attr == "addsitedir")):
            found.append(node.lineno)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            found += [node.lineno for t in targets if is_sys_path(t)]
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(
                alias.name == "path" for alias in node.names):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_edits_the_import_path():
    """Found by syntax, not by text: a docstring that mentions sys.path is no edit, and an
    ``insert`` spelled over two lines is still one."""
    files = tracked_python()
    assert len(files) > 100  # the checkout's own files were found
    offenders = {}
    for path in files:
        with open(os.path.join(ROOT, path)) as f:
            lines = edits_the_path(ast.parse(f.read(), path))
        if lines:
            offenders[path] = lines
    assert offenders == {}


def test_the_path_check_finds_each_way_of_editing_the_path():
    source = ("import sys\nsys.path.insert(0, 'a')\nsys.path.append(\n    'b')\nsys.path += ['c']\n"
              "sys.path = ['d']\nx = 'sys.path.insert(0, q)'\nsys.path[:0] = ['e']\n"
              "from sys import path\nsite.addsitedir('f')\ndel sys.path[0]\nprint(sys.path)\n")
    assert edits_the_path(ast.parse(source)) == [2, 3, 5, 6, 8, 9, 10, 11]


def modules_named(text: str) -> set[str]:
    return set(re.findall(r"-m (scripts(?:\.[a-z_0-9]+)+)", text))


def test_every_command_in_the_docs_names_a_module_of_scripts():
    """``python -m scripts.X`` (and ``torchrun -m``) in the README, the Makefile and docs/: X is a
    file of the package; and every ``scripts/...py`` path they name exists."""
    commands, paths = set(), set()
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        commands |= modules_named(text)
        paths |= set(re.findall(r"(?<![\w/.-])(scripts/[a-z_/]+\.py)\b", text))
    assert {"scripts.compare", "scripts.quality", "scripts.cluster", "scripts.tools.bench_compressors",
            "scripts.studies.simulate_mnist"} <= commands
    assert "scripts/compare.py" in paths and len(paths) >= 5  # the paths were found
    missing = sorted(m for m in commands
                     if not os.path.isfile(os.path.join(ROOT, *m.split(".")) + ".py"))
    assert missing == []
    assert sorted(p for p in paths if not os.path.isfile(os.path.join(ROOT, p))) == []
    for module in commands:  # a command runs something: the module has a main block
        with open(os.path.join(ROOT, *module.split(".")) + ".py") as f:
            assert 'if __name__ == "__main__":' in f.read(), module


def test_the_docs_give_no_script_to_run_by_its_path():
    """A module of the package imports its neighbours as ``scripts.<name>``, which a file run by
    its path cannot: the docs say ``python -m scripts.<name>``, never ``python scripts/<name>.py``
    nor a script path followed by its options."""
    by_path = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            for number, line in enumerate(f, 1):
                if re.search(r"python3? (\./)?scripts/|(?<![\w/.-])scripts/[a-z_/]+\.py --", line):
                    by_path.append(f"{doc}:{number}")
    assert by_path == []


def test_a_harness_command_runs_from_the_checkout_without_a_path_set():
    """What the docs tell a user to type, with no ``PYTHONPATH``: the package resolves from the
    working folder alone."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "scripts.tools.cost_model", "--help"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


# An inline link or image, its target in angle brackets or not, a title after it or not; and a
# reference-style definition ("[name]: target").
LINK = re.compile(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)|^\s*\[[^\]]+\]:\s+<?(\S+?)>?(?:\s|$)", re.M)


def test_every_link_between_the_pages_and_the_runs_leads_to_a_file():
    """A relative link of any page (README, CHANGELOG, docs/, the pages kept with the runs under
    data/) names a file or folder that is there: the pages link the runs in data/ as ``../data/``,
    and a run folder moved or renamed without its links fails here."""
    pages = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    links, broken = 0, []
    for page in pages:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for inline, defined in LINK.findall(text):
            target = (inline or defined).split("#")[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            links += 1
            if not os.path.exists(os.path.join(ROOT, os.path.dirname(page), target)):
                broken.append(f"{page}: {target}")
    assert links >= 200 and broken == []  # 210 when the runs moved to data/
    tracked = subprocess.run(["git", "ls-files", "docs"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert not [p for p in tracked if p.count("/") > 1], \
        "docs/ holds the pages only; a study's runs and what its tools made of them go under data/"
