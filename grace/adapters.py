"""How the core finds what the framework adapters provide without importing them: each registers
itself as an entry point, in one of three groups.

- ``grace.ops``: a tensor's top-level module (``torch``, ``tensorflow``, ``numpy``) to its ``Ops``
  adapter, loaded the first time ``ops_for`` meets such a tensor (so ``import grace`` imports
  neither torch nor TensorFlow).
- ``grace.on_import``: functions run at the end of ``import grace``: Horovod's routing
  (``frameworks/internals.py``), so that ``hvd.DistributedOptimizer(..., compression=grace.topk())``
  works after ``import grace``.
- ``grace.exports``: names ``grace.<name>`` gives on first use (``grace.ddp_hook``, which needs
  torch).

This distribution's own adapters are listed in ``grace-entry-points.cfg`` at the top of the
source tree, which ``setup.py`` installs into the distribution's metadata. A source tree is read
directly, so that a checkout on ``sys.path`` (``PYTHONPATH=...``, an editable install whose
metadata predates a change) finds what it holds; an installed wheel is read from its metadata.
Entry points are Python's standard plugin mechanism (``importlib.metadata``): another package
registers adapters of its own in its metadata, and the core names none of them."""

from __future__ import annotations

import configparser
import functools
import importlib
import os
from importlib import metadata
from typing import Any

DISTRIBUTION = "grace-compression"
SOURCE_LIST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "grace-entry-points.cfg")
"""This distribution's registrations, where grace runs from its source tree."""


def _from_source(group: str) -> dict[str, str]:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # names are case-sensitive (DDPState)
    parser.read(SOURCE_LIST)
    return dict(parser.items(group)) if parser.has_section(group) else {}


def _from_metadata(group: str) -> dict[str, str]:
    points = metadata.entry_points()
    found = points.select(group=group) if hasattr(points, "select") else points.get(group, ())
    return {point.name: point.value for point in found}


@functools.lru_cache(maxsize=None)
def registered(group: str) -> dict[str, str]:
    """The entry points of ``group``: name to ``"module:attribute"``. This source tree's, then
    those of installed packages (this distribution's own metadata, where it is installed, says
    the same as its source list)."""
    found = _from_metadata(group)
    if os.path.exists(SOURCE_LIST):
        found.update(_from_source(group))
    return found


@functools.lru_cache(maxsize=None)
def load(group: str, name: str) -> Any:
    """The object registered as ``name`` in ``group`` (imported once)."""
    module, _, attribute = registered(group)[name].partition(":")
    target: Any = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def run_on_import() -> None:
    """Run every ``grace.on_import`` function, in the order of their names."""
    for name in sorted(registered("grace.on_import")):
        load("grace.on_import", name)()
