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
    """Half-precision casts (2 bytes per element), allreduce."""
    return build("fp16", **options)


def bf16(**options: Any) -> Pipeline:
    """bfloat16 casts (2 bytes per element), allreduce."""
    return build("bf16", **options)


def topk(ratio: float = 0.01, **options: Any) -> Pipeline:
    """Top-k sparsification of ``ratio`` of each tensor, error feedback, allgather."""
    return build("topk", ratio=ratio, **options)


def randomk(ratio: float = 0.01, seed: int = 0, scale: bool = False, **options: Any) -> Pipeline:
    """Random-k sparsification with indices from a shared seed, error feedback, allreduce."""
    return build("randomk", ratio=ratio, seed=seed, scale=scale, **options)


def threshold(threshold: float = 0.01, **options: Any) -> Pipeline:
    """Entries of magnitude >= ``threshold``, error feedback, allgather."""
    return build("threshold", threshold=threshold, **options)


def dgc(ratio: float = 0.001, **options: Any) -> Pipeline:
    """Deep Gradient Compression (sampled top-k, momentum correction and masking), allgather.
    Options: ``sample_ratio``, ``sparsity_warmup_steps``, ``seed``; memory: ``momentum`` (the
    optimizer's, taken over) and ``clip_norm``."""
    return build("dgc", ratio=ratio, **options)


def qsgd(levels: int = 7, **options: Any) -> Pipeline:
    """QSGD with ``levels`` quantization levels (1 + ceil(log2(levels + 1)) bits), allgather."""
    return build("qsgd", levels=levels, **options)


def terngrad(**options: Any) -> Pipeline:
    """TernGrad: scale and {-1, 0, 1} (2 bits), unbiased, allgather."""
    return build("terngrad", **options)


def onebit(**options: Any) -> Pipeline:
    """1-bit SGD: a bit per element and two means, error feedback, allgather."""
    return build("onebit", **options)


def signsgd(**options: Any) -> Pipeline:
    """signSGD with majority vote (1 bit per element), allgather."""
    return build("signsgd", **options)


def signum(beta: float | None = None, **options: Any) -> Pipeline:
    """signum: signs of momentum, majority vote, allgather. ``beta``: the wrapped optimizer's
    momentum, taken over (else 0.9)."""
    return build("signum", **({} if beta is None else {"beta": beta}), **options)


def efsignsgd(**options: Any) -> Pipeline:
    """Error-feedback signSGD (scaled sign), allgather."""
    return build("efsignsgd", **options)


def natural(**options: Any) -> Pipeline:
    """Natural compression: stochastic rounding to powers of two (9 bits), allgather."""
    return build("natural", **options)


def powersgd(rank: int = 2, **options: Any) -> Pipeline:
    """PowerSGD of rank ``rank``, error feedback, two allreduces; vectors dense."""
    return build("powersgd", rank=rank, **options)


def u8bit(**options: Any) -> Pipeline:
    """8-bit approximation: sign + 7-bit index into a table of magnitudes, allgather."""
    return build("u8bit", **options)


def sketch(buckets: int = 256, **options: Any) -> Pipeline:
    """SketchML quantile buckets: a byte per element and the bucket means, allgather."""
    return build("sketch", buckets=buckets, **options)


def adaq(ratio: float = 0.01, **options: Any) -> Pipeline:
    """Adaptive quantization: indices beyond sampled thresholds and one mean per sign."""
    return build("adaq", ratio=ratio, **options)


def inceptionn(error_bound: float = 2.0**-10, **options: Any) -> Pipeline:
    """INCEPTIONN's error-bounded 0/8/16/32-bit encoding, allgather."""
    return build("inceptionn", error_bound=error_bound, **options)


horovod_hook.install()

__all__ = [
    "Collectives", "Communicator", "Compressor", "Context", "Memory", "Ops", "Pipeline",
    "DEFAULT_MIN_NUMEL", "available", "build", "compressor_params", "from_params", "ops_for",
    "none", "fp16", "bf16", "topk", "randomk", "threshold", "dgc", "qsgd", "terngrad", "onebit",
    "signsgd", "signum", "efsignsgd", "natural", "powersgd", "u8bit", "sketch", "adaq", "inceptionn",
]
