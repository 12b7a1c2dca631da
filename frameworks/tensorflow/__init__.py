"""grace over TensorFlow: ``TensorFlowOps``, Horovod's TF collectives, and the explicit wrappers with
Horovod's signatures: ``DistributedGradientTape``, ``DistributedOptimizer`` (TF1-style optimizers),
and, for Keras 3, ``keras.DistributedOptimizer``, ``keras.BroadcastGlobalVariablesCallback`` and
``keras.broadcast_variables``. Imported on first use, so that inspecting a compressor on a TF tensor
does not need Horovod."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TensorFlowOps": "frameworks.tensorflow.ops",
    "HorovodCollectives": "frameworks.tensorflow.collectives",
    "DistributedGradientTape": "frameworks.tensorflow.tape",
    "DistributedOptimizer": "frameworks.tensorflow.tape",
    "make_reduce_grads": "frameworks.tensorflow.reduce",
    "CompressionState": "frameworks.tensorflow.checkpoint",
}

__all__ = [*_EXPORTS, "keras"]


def __getattr__(name):
    if name == "keras":
        return importlib.import_module("frameworks.tensorflow.keras")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'frameworks.tensorflow' has no attribute {name!r}")
