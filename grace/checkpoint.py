"""A pipeline's state as a checkpoint: ``save`` makes what ``Pipeline.state_dict`` returns, and
``load`` puts it back for ``Pipeline.load_state_dict``.

The pipeline names its parts that keep state (``Pipeline._state_parts``: the compressor's, the
memories', the warm-up's counts, the sparse rows', Adam's moments), each a dict of stores keyed by
tensor name; they are saved beside the pipeline's ``repr`` (``config``) and its byte counts. A
checkpoint loads only into a pipeline of the same ``repr``, so that no state lands in a part that
reads it otherwise; two differences are let through: a parameter saved under its former name, and
another ``min_numel`` where no tensor's state is held."""

from __future__ import annotations

import re
from typing import Any

from grace.compressor import RENAMED_PARAMS
from grace.ops import Ops
from grace.state import StateStore


def save(config: str, parts: dict[str, dict[str, dict]], counters: dict) -> dict[str, Any]:
    """``parts``' stores and ``counters`` as copies (``StateStore.export``), beside ``config``."""
    return ({"config": config} | {part: StateStore.export(stores) for part, stores in parts.items()}
            | {"stats": StateStore.export({"counters": counters})["counters"]})


def load(state: dict[str, Any], config: str, parts: dict[str, dict[str, dict]], counters: dict,
         ops: Ops | None = None) -> None:
    """Put ``state`` (``save``'s result) back into ``parts``' stores and ``counters``; refused
    where it was saved by another pipeline than ``config`` says."""
    saved = str(state.get("config"))
    for former, name in RENAMED_PARAMS.items():  # a checkpoint from before a parameter's rename
        saved = saved.replace(f"{former}=", f"{name}=")
    if saved != config and not _differs_in_min_numel_only(saved, config, state):
        raise ValueError(f"this compression state was saved by {state.get('config')}, not by "
                         f"{config}: build the same pipeline before loading it")
    for part, stores in parts.items():
        for attr, entries in state.get(part, {}).items():
            for name, value in entries.items():
                StateStore.restore(stores[attr], name, value, ops)
    for key, value in state["stats"].items():
        StateStore.restore(counters, key, value, ops)


def _differs_in_min_numel_only(saved: str, config: str, state: dict[str, Any]) -> bool:
    """Whether a checkpoint saved under another ``min_numel`` still fits: it keeps no tensor's
    state (a cast, none: byte counts only), so no state can be missing or misplaced. fp16's
    default became 0 where it was 1024; its checkpoints saved before load as they did."""
    def without(text: str) -> str:
        return re.sub(r"min_numel=\d+", "min_numel=?", text)
    held = any(entries for part, stores in state.items() if part not in ("config", "stats")
               and isinstance(stores, dict) for entries in stores.values())
    return not held and without(saved) == without(config)
