"""Names → classes, each compressor's defaults, and the builders behind ``grace.topk(...)`` and
``grace.from_params(...)``. Every mistake is a ``ValueError`` raised here, at construction."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from grace.bucketing import DEFAULT_BUCKET_BYTES
from grace.communicator import Communicator
from grace.communicators import Allgather, Allreduce, Alltoall, Auto, Broadcast
from grace.compressor import Compressor
from grace.compressors import CATALOGUE
from grace.memories import MEMORIES as MEMORY_CLASSES
from grace.memory import Memory
from grace.pipeline import GRANULARITIES, Pipeline
from grace.validation import check_bool, check_choice, check_int

COMPRESSORS: dict[str, type[Compressor]] = {cls.name: cls for cls in CATALOGUE}
MEMORIES: dict[str, type[Memory]] = {cls.name: cls for cls in MEMORY_CLASSES}
COMMUNICATORS: dict[str, type[Communicator]] = {
    cls.name: cls for cls in (Allreduce, Allgather, Alltoall, Auto, Broadcast)
}

_PIPELINE_KEYS = ("compressor", "memory", "communicator", "min_numel", "check_finite", "warmup_steps",
                  "granularity", "bucket_bytes", "hierarchical", "keep_optimizer")


def default_communicator(cls: type[Compressor]) -> str:
    """A compressor's communicator when none is named: its paper's ``allreduce`` for payloads that
    add up, else ``auto`` (gathered on small jobs, through the shards' owners on large ones:
    ``grace.communicators.Auto``)."""
    return "auto" if cls.default_communicator == "allgather" else cls.default_communicator


def available() -> list[str]:
    """The names of all compressors, as ``grace.<name>(...)`` and ``from_params`` accept them."""
    return sorted(COMPRESSORS)


def _init_params(cls) -> dict[str, Any]:
    return {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
            if p.name not in ("self", "args", "kwargs")}


def compressor_params(name: str) -> dict[str, Any]:
    """A compressor's parameters and their defaults."""
    return _init_params(COMPRESSORS[check_choice("compressor", name, COMPRESSORS)])


def memory_params(name: str) -> dict[str, Any]:
    """A memory's parameters (e.g. DGC's ``momentum``) and their defaults."""
    return _init_params(MEMORIES[check_choice("memory", name, MEMORIES)])


def build(compressor: str, *, memory: str | None = None, communicator: str | None = None,
          min_numel: int | None = None, check_finite: bool = True, warmup_steps: int | None = None,
          granularity: str = "layer", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
          hierarchical: bool = False, keep_optimizer: bool = False, **params: Any) -> Pipeline:
    """A pipeline for the named compressor with its paper's defaults, ``memory`` and
    ``communicator`` overridden by name when given, and the compressor's own ``params``.
    ``check_finite=False`` saves the 4-byte flag per tensor at the price of Inf/NaN gradients
    entering residuals and momenta (see ``Pipeline``). ``min_numel``: tensors with fewer elements
    travel dense (the compressor's ``default_min_numel`` when not given: ``DEFAULT_MIN_NUMEL``, 0
    for fp16). ``warmup_steps``: exchanges sent dense before
    compression starts (the compressor's ``default_warmup_steps`` when not given). ``granularity``:
    ``"layer"`` compresses each tensor on its own, ``"bucket"`` a bucket's tensors as one vector;
    ``bucket_bytes``: the dense bytes of gradients that travel together (0: every tensor alone);
    ``hierarchical``: sum dense within each host and compress only between hosts
    (``grace.hierarchy``); ``keep_optimizer``: leave the wrapped optimizer as the user set it, its
    momentum and Adam's moments not taken over (docs/user-guide.md, "What grace changes, and how
    to keep it"); see ``Pipeline``."""
    name = check_choice("compressor", compressor, COMPRESSORS)
    cls = COMPRESSORS[name]
    memory = check_choice("memory", memory or cls.default_memory, MEMORIES)
    communicator = check_choice("communicator", communicator or default_communicator(cls),
                                COMMUNICATORS)
    own, of_memory = compressor_params(name), memory_params(memory)
    unknown = sorted(set(params) - set(own) - set(of_memory))
    if unknown:
        accepted = ", ".join(list(own) + list(of_memory) + list(_PIPELINE_KEYS[1:]))
        raise ValueError(f"unknown parameter {unknown[0]!r} for compressor {name!r} with memory "
                         f"{memory!r}; accepted: {accepted}")
    min_numel = check_int("min_numel", cls.default_min_numel if min_numel is None else min_numel,
                          minimum=0)
    check_finite = check_bool("check_finite", check_finite)
    warmup_steps = check_int("warmup_steps", cls.default_warmup_steps if warmup_steps is None
                             else warmup_steps, minimum=0)
    granularity = check_choice("granularity", granularity, GRANULARITIES)
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, minimum=0)
    hierarchical = check_bool("hierarchical", hierarchical)
    keep_optimizer = check_bool("keep_optimizer", keep_optimizer)
    compressor_obj = cls(**{k: v for k, v in params.items() if k in own})
    memory_obj = MEMORIES[memory](**{k: v for k, v in params.items() if k in of_memory})
    return Pipeline(compressor_obj, memory_obj, COMMUNICATORS[communicator](), min_numel, check_finite,
                    warmup_steps, granularity, bucket_bytes, hierarchical, keep_optimizer)


def factory(name: str) -> Callable[..., Pipeline]:
    """``grace.<name>(...)``: ``build(name, ...)`` taking the compressor's own parameters by name or
    in their constructor's order (``grace.topk(0.01)``), then ``build``'s options by name. Its
    signature and summary come from the compressor's class, so that no default is written twice."""
    cls = COMPRESSORS[name]
    own = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
           for p in inspect.signature(cls.__init__).parameters.values()
           if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    def make(*args: Any, **options: Any) -> Pipeline:
        if len(args) > len(own):
            raise TypeError(f"grace.{name}() takes {len(own)} positional argument(s) "
                            f"({', '.join(p.name for p in own) or 'none'}), {len(args)} given")
        for parameter, value in zip(own, args):
            if parameter.name in options:
                raise TypeError(f"grace.{name}() got {parameter.name!r} twice")
            options[parameter.name] = value
        return build(name, **options)

    make.__name__ = make.__qualname__ = name
    make.__module__ = "grace"
    options = inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD, annotation=Any)
    make.__signature__ = inspect.Signature([*own, options], return_annotation=Pipeline)
    summary = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
    make.__doc__ = (f"{summary}\n\nA ``Pipeline`` with {cls.__name__} (default memory "
                    f"``{cls.default_memory}``, communicator ``{default_communicator(cls)}``); "
                    f"``options``: those of ``grace.build``.")
    return make


def from_params(params: Mapping[str, Any]) -> Pipeline:
    """Build a pipeline from a plain dict, e.g. ``{"compressor": "topk", "ratio": 0.01, "memory":
    "residual", "communicator": "allgather"}`` (a config file, a command line)."""
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a dict, got {type(params).__name__}")
    if "compressor" not in params:
        raise ValueError(f"params needs a 'compressor' key; one of: {', '.join(available())}")
    rest = dict(params)
    return build(rest.pop("compressor"), **rest)  # build names any unknown parameter
