"""``grace.collectives.Collectives`` over Horovod's asynchronous torch ops."""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch

from frameworks.process_set import ProcessSetCollectives
from frameworks.torch.ops import TorchOps
from grace.steps import bf16_rows_sum

_OPS = TorchOps()


class HorovodCollectives(ProcessSetCollectives):
    """Horovod's async allreduce (sum), allgather and broadcast among one process set."""

    horovod = hvd

    def __init__(self, process_set=None):
        super().__init__(process_set, hvd.global_process_set)

    def allreduce_async(self, tensor, name):
        if tensor.dtype == torch.bfloat16:
            # Horovod 0.28.1 cannot reduce bfloat16: gather the bits, add in float32 in rank order
            # (the same on every worker), round once (grace.steps.bf16_rows_sum).
            handle = hvd.allgather_async(tensor.reshape(1, -1).view(torch.int16), name=name,
                                         process_set=self.process_set)
            return _SummedBits(handle, tensor.shape)
        return hvd.allreduce_async(tensor, name=name, op=hvd.Sum, process_set=self.process_set)

    def allreduce_given_async(self, tensor, name):
        """The sum written into ``tensor`` itself (Horovod's in-place op, as its own optimizer
        reduces gradients): the caller reads it no more."""
        if tensor.dtype == torch.bfloat16:
            return self.allreduce_async(tensor, name)
        return hvd.allreduce_async_(tensor, name=name, op=hvd.Sum, process_set=self.process_set)

    # Horovod 0.28.1 has no bfloat16 ops: gathers and broadcasts carry such tensors as their bits.
    def allgather_async(self, tensor, name):
        return _bits_in(tensor, lambda t: hvd.allgather_async(t, name=name, process_set=self.process_set))

    def broadcast_async(self, tensor, root, name):
        return _bits_in(tensor, lambda t: hvd.broadcast_async(t, root_rank=self.global_rank(root),
                                                              name=name,
                                                              process_set=self.process_set))

    def alltoall_async(self, tensor, splits, name):
        # Horovod takes the splits on the host; its result comes with the received splits, which
        # grace's payloads do not need (each carries its own lengths).
        return _Scattered(_bits_in(tensor, lambda t: hvd.alltoall_async(
            t, splits=splits.to("cpu"), name=name, process_set=self.process_set)))

    def synchronize(self, handle):
        wait(_horovod_handle(handle))
        if isinstance(handle, _Scattered):
            inner = handle.handle
            bits = isinstance(inner, _AsBits)
            received, _ = hvd.synchronize(inner.handle if bits else inner)
            return received.view(torch.bfloat16) if bits else received
        if isinstance(handle, _SummedBits):
            return summed_bf16(hvd.synchronize(handle.handle), handle.shape)
        if isinstance(handle, _AsBits):
            return hvd.synchronize(handle.handle).view(torch.bfloat16)
        return hvd.synchronize(handle)


FIRST_NAP_S = 50e-6
LONGEST_NAP_S = 1e-3
NAP_SHARE = 0.1


def wait(handle: int) -> None:
    """Until Horovod has finished the operation ``handle``, asleep between polls.

    Horovod 0.28's own ``synchronize`` waits by calling ``sched_yield`` in a loop, so a waiting
    worker keeps a core busy. Where workers share cores with each other or with Horovod's own
    threads (several workers per host, a data loader), the spinning takes the core from the work
    being waited for: on the project's emulated cluster (2 cores), 4 workers with
    ``hierarchical=True`` took 7.3 s a step spinning and 0.84 s asleep (docs/performance.md,
    "Waiting for Horovod"). Each nap is a tenth of the time waited so far, from 50 us to 1 ms,
    so a wait ends at most ~10% (and 1 ms) after its operation."""
    start = time.perf_counter()
    while not hvd.poll(handle):
        waited = time.perf_counter() - start
        time.sleep(min(LONGEST_NAP_S, max(FIRST_NAP_S, waited * NAP_SHARE)))


def _horovod_handle(handle) -> int:
    """Horovod's own handle inside one of this module's wrappers."""
    while isinstance(handle, (_Scattered, _AsBits, _SummedBits)):
        handle = handle.handle
    return handle


class _AsBits:
    def __init__(self, handle):
        self.handle = handle


class _Scattered:
    def __init__(self, handle):
        self.handle = handle


class _SummedBits:
    def __init__(self, handle, shape):
        self.handle, self.shape = handle, shape


def summed_bf16(rows: torch.Tensor, shape) -> torch.Tensor:
    """The bfloat16 sum, shaped ``shape``, of the rows of bits (int16, one per worker) that Horovod
    gathered (``grace.steps.bf16_rows_sum``)."""
    bits = bf16_rows_sum(_OPS, rows, workers=rows.shape[0], n=rows.shape[1])
    return bits.view(torch.bfloat16).reshape(shape)


def _bits_in(tensor, start):
    if tensor.dtype == torch.bfloat16:
        return _AsBits(start(tensor.view(torch.int16)))
    return start(tensor)
