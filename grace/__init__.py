"""grace: gradient compression for Horovod, each algorithm written once for PyTorch and TensorFlow.

    import horovod.torch as hvd
    import grace

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=grace.topk(0.01))

Each factory returns a ``Pipeline`` (compressor + memory + communicator) with the paper's defaults;
``memory=`` and ``communicator=`` override them by name, ``min_numel=`` sets the size below which
tensors stay dense. ``grace.from_params(dict)`` builds the same from a plain dict.
"""

from __future__ import annotations

from typing import Any

from grace import horovod_hook
from grace.collectives import Collectives
from grace.communicator import Communicator
from grace.compressor import Compressor, Context
from grace.memory import Memory
from grace.ops import Ops, ops_for
from grace.pipeline import Pipeline
from grace.registry import DEFAULT_MIN_NUMEL, available, build, compressor_params, from_params

__version__ = "0.1.0"


def none(**options: Any) -> Pipeline:
    """No compression (the fp32 baseline), through grace's wrappers."""
    return build("none", **options)


def fp16(**options: Any) -> Pipeline:
    """Half-precision casts (2 bytes per element)."""
    return build("fp16", **options)


def topk(ratio: float = 0.01, **options: Any) -> Pipeline:
    """Top-k sparsification of ``ratio`` of each tensor, error feedback, allgather."""
    return build("topk", ratio=ratio, **options)


def randomk(ratio: float = 0.01, seed: int = 0, scale: bool = False, **options: Any) -> Pipeline:
    """Random-k sparsification with indices from a shared seed, error feedback, allreduce."""
    return build("randomk", ratio=ratio, seed=seed, scale=scale, **options)


horovod_hook.install()

__all__ = [
    "Collectives", "Communicator", "Compressor", "Context", "Memory", "Ops", "Pipeline",
    "DEFAULT_MIN_NUMEL", "available", "build", "compressor_params", "from_params", "ops_for",
    "none", "fp16", "topk", "randomk",
]
