"""PyTorch's own DDP communication hooks by name, each configured as its documentation recommends,
for the benchmarks that set them beside grace's hook (``bench_ddp_hooks.py``, ``compare.py``
``--engines ddp``, ``quality.py``).

PowerSGD runs with error feedback and warm start, ``start_powerSGD_iter`` at its minimum (2) and
``min_compression_rate=1`` (every matrix compressed, as grace's ``min_numel=0`` would; grace's own
default leaves matrices of fewer than 1,024 elements dense).

Which of them run where (torch 2.13, measured): on Gloo (CPU) ``fp16_compress_hook`` runs, and
``powerSGD_hook`` runs while a step has at most two buckets waiting (its callbacks wait on a
collective while they hold one of Gloo's two threads: the mnist MLP, one bucket, trains; ResNet-50
hangs). ``bf16_compress_hook`` refuses anything but NCCL or XCCL; the quantization hooks' callbacks
index the allgather's result as NCCL returns it and fail on Gloo; ``batched_powerSGD_hook`` fails an
assertion in torch 2.11 and 2.13 on either backend. ``NOT_ON_GLOO`` names the ones that cannot run
on the CPU, with the reason.
"""

from __future__ import annotations

import math

# name -> (hook's attribute path, PowerSGD's rank or None)
HOOKS = {
    "torch-fp16": ("default_hooks.fp16_compress_hook", None),
    "torch-bf16": ("default_hooks.bf16_compress_hook", None),
    "torch-quant-tensor": ("quantization_hooks.quantization_pertensor_hook", None),
    "torch-quant-channel": ("quantization_hooks.quantization_perchannel_hook", None),
    "torch-powersgd-r1": ("powerSGD_hook.powerSGD_hook", 1),
    "torch-powersgd-r2": ("powerSGD_hook.powerSGD_hook", 2),
    "torch-batched-powersgd-r1": ("powerSGD_hook.batched_powerSGD_hook", 1),
    "torch-batched-powersgd-r2": ("powerSGD_hook.batched_powerSGD_hook", 2),
}
NOT_ON_GLOO = {
    "torch-bf16": "needs NCCL (CUDA 11+, NCCL 2.10+) or XCCL",
    "torch-quant-tensor": "its callback indexes the allgather's result as NCCL returns it",
    "torch-quant-channel": "its callback indexes the allgather's result as NCCL returns it",
    "torch-batched-powersgd-r1": "fails an assertion (a 2-d matrix where 3-d is expected)",
    "torch-batched-powersgd-r2": "fails an assertion (a 2-d matrix where 3-d is expected)",
}


def check(name: str) -> str:
    """``name`` if it is one of ``HOOKS``, else a ValueError naming the allowed values."""
    if name not in HOOKS:
        raise ValueError(f"PyTorch DDP hook {name!r}: not one of {', '.join(HOOKS)}")
    return name


def make(name: str, process_group=None):
    """(hook, state) to pass to ``DistributedDataParallel.register_comm_hook(state, hook)``."""
    import importlib

    module, _, attr = HOOKS[check(name)][0].rpartition(".")
    hook = getattr(importlib.import_module(
        f"torch.distributed.algorithms.ddp_comm_hooks.{module}"), attr)
    rank = HOOKS[name][1]
    if rank is None:
        return hook, process_group  # the stateless hooks take the process group as their state
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    return hook, psgd.PowerSGDState(process_group=process_group, matrix_approximation_rank=rank,
                                    start_powerSGD_iter=START_POWERSGD_ITER, min_compression_rate=1,
                                    use_error_feedback=True, warm_start=True)


START_POWERSGD_ITER = 2  # the least PyTorch allows: plain allreduce for the steps before it


def warmup_steps(name: str) -> int:
    """Steps before hook ``name`` compresses: PowerSGD's ``start_powerSGD_iter``, else 0."""
    return START_POWERSGD_ITER if HOOKS[check(name)][1] is not None else 0


PER_BUCKET = ("torch-quant-tensor", "torch-quant-channel", "torch-batched-powersgd-r1",
              "torch-batched-powersgd-r2")
"""Hooks whose payload depends on how DDP buckets the tensors (the quantization hooks' padding and
scales, batched PowerSGD's one square matrix per bucket): ``payload_bytes`` does not give it."""


def payload_bytes(name: str, shapes: list[tuple[int, ...]]) -> int:
    """What one worker sends per step through hook ``name`` once compression has started, for
    gradients of ``shapes``: fp16/bf16 two bytes an element; PowerSGD (rank r) its P and Q factors,
    (rows + columns) x r floats for every tensor of two or more dimensions viewed as rows x the rest
    (``min_compression_rate=1``: where that is no larger), the others sent whole. The hooks of
    ``PER_BUCKET`` are refused."""
    if check(name) in PER_BUCKET:
        raise ValueError(f"{name}'s payload depends on DDP's buckets: not computed per tensor")
    numels = [math.prod(s) for s in shapes]
    kind, rank = HOOKS[name]
    if rank is not None:
        total = 0
        for shape, numel in zip(shapes, numels):
            if len(shape) < 2:
                total += 4 * numel
                continue
            rows, cols = shape[0], numel // shape[0]
            total += 4 * min(numel, (rows + cols) * rank)
        return total
    return 2 * sum(numels)  # fp16, bf16
