"""Routes ``hvd.DistributedOptimizer(..., compression=grace.topk(...))`` to grace's wrappers.

Horovod's own wrappers can only allreduce a compressed tensor. When a grace ``Pipeline`` is passed as
``compression``, the wrapper functions of ``horovod.torch`` (and ``horovod.tensorflow``,
``horovod.tensorflow.keras``) hand over to ``frameworks.<fw>``; with anything else (``hvd.Compression.fp16``,
``.none``) they are Horovod's own, untouched. Nothing is copied into Horovod's installation: the
module attributes are wrapped when the module is imported, whether that happens before or after
``import grace``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import inspect
import sys

# Horovod module -> {its wrapper function: "the grace wrapper with the same signature"}
ROUTES = {
    "horovod.torch": {
        "DistributedOptimizer": "frameworks.torch.optimizer:DistributedOptimizer",
    },
    "horovod.tensorflow": {
        "DistributedGradientTape": "frameworks.tensorflow.tape:DistributedGradientTape",
        "DistributedOptimizer": "frameworks.tensorflow.tape:DistributedOptimizer",
    },
    "horovod.tensorflow.keras": {
        "DistributedOptimizer": "frameworks.tensorflow.keras:DistributedOptimizer",
    },
}
def route(original, target: str):
    """``original`` unless its ``compression`` argument is a grace ``Pipeline``, then ``target``
    ("module:function", imported on first use) with the same arguments."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def routed(*args, **kwargs):
        from grace.pipeline import Pipeline

        if isinstance(signature.bind(*args, **kwargs).arguments.get("compression"), Pipeline):
            module, function = target.split(":")
            return getattr(importlib.import_module(module), function)(*args, **kwargs)
        return original(*args, **kwargs)

    routed.__grace_original__ = original
    return routed


def _patch(module) -> None:
    if getattr(module, "_grace_patched", False):
        return
    for name, target in ROUTES[module.__name__].items():
        if hasattr(module, name):
            setattr(module, name, route(getattr(module, name), target))
    module._grace_patched = True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the other finders find a Horovod module and wraps its loader so that
    the module is patched right after it executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in ROUTES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, _exec=exec_module):
                    _exec(module)
                    _patch(module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


def install() -> None:
    """Patch the Horovod modules already imported and those imported later. Idempotent."""
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name in ROUTES:
        if name in sys.modules:
            _patch(sys.modules[name])
