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

from grace import adapters
from grace.collectives import Collectives
from grace.communicator import Communicator
from grace.compressor import DEFAULT_MIN_NUMEL, Compressor, Context
from grace.memory import Memory
from grace.ops import Ops, ops_for
from grace.pipeline import Pipeline
from grace.registry import (
    available,
    build,
    compressor_params,
    factory,
    from_params,
)

__version__ = "0.1.0"


# One factory per compressor, ``grace.topk(0.01, memory=..., min_numel=...)``: signature, defaults and
# summary are the compressor class's own (``registry.factory``).
none = factory("none")
fp16 = factory("fp16")
bf16 = factory("bf16")
topk = factory("topk")
randomk = factory("randomk")
threshold = factory("threshold")
dgc = factory("dgc")
qsgd = factory("qsgd")
terngrad = factory("terngrad")
onebit = factory("onebit")
signsgd = factory("signsgd")
signum = factory("signum")
efsignsgd = factory("efsignsgd")
natural = factory("natural")
powersgd = factory("powersgd")
u8bit = factory("u8bit")
sketch = factory("sketch")
adaq = factory("adaq")
inceptionn = factory("inceptionn")
twobit = factory("twobit")

# Horovod's routing, from the adapters (``grace.adapters``): grace's factories exist by now.
adapters.run_on_import()


def __getattr__(name: str):
    # The DDP communication hook (``ddp.register_comm_hook(grace.topk(0.01), grace.ddp_hook)``)
    # needs torch: registered by its adapter, imported on first use, so that ``import grace``
    # needs neither torch nor Horovod.
    if name in adapters.registered("grace.exports"):
        return adapters.load("grace.exports", name)
    raise AttributeError(f"module 'grace' has no attribute {name!r}")


__all__ = [
    "Collectives", "Communicator", "Compressor", "Context", "Memory", "Ops", "Pipeline",
    "DEFAULT_MIN_NUMEL", "available", "build", "compressor_params", "from_params", "ops_for",
    "none", "fp16", "bf16", "topk", "randomk", "threshold", "dgc", "qsgd", "terngrad", "onebit",
    "signsgd", "signum", "efsignsgd", "natural", "powersgd", "u8bit", "sketch", "adaq", "inceptionn",
    "twobit", "ddp_hook", "DDPState", "LightningCommHook",
]
