"""grace over PyTorch: ``TorchOps``, Horovod's torch collectives, and ``DistributedOptimizer`` with
Horovod's signature. Attributes are imported on first use, so that inspecting a compressor on a torch
tensor does not need Horovod."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TorchOps": "frameworks.torch.ops",
    "HorovodCollectives": "frameworks.torch.collectives",
    "DistributedOptimizer": "frameworks.torch.optimizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'frameworks.torch' has no attribute {name!r}")
