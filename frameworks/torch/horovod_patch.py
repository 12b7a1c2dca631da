"""Wraps ``horovod.torch.DistributedOptimizer`` so that a grace pipeline passed as ``compression``
goes to ``frameworks.torch.DistributedOptimizer``; any other compression is Horovod's own path."""

from __future__ import annotations

import functools
import inspect


def patch_horovod(module) -> None:
    original = module.DistributedOptimizer
    signature = inspect.signature(original)

    @functools.wraps(original)
    def DistributedOptimizer(*args, **kwargs):
        from grace.pipeline import Pipeline

        bound = signature.bind(*args, **kwargs)
        if isinstance(bound.arguments.get("compression"), Pipeline):
            from frameworks.torch.optimizer import DistributedOptimizer as grace_optimizer

            return grace_optimizer(*args, **kwargs)
        return original(*args, **kwargs)

    DistributedOptimizer.__grace_original__ = original
    module.DistributedOptimizer = DistributedOptimizer
