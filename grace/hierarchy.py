"""Compression only between hosts (``hierarchical=True``): dense within a host, compressed across.

Within a host the workers' links are fast (NVLink, shared memory), between hosts slow. With
``hierarchical=True`` a bucket's gradients are first summed dense among the workers of each host
(one allreduce per dtype, in the host's process set); one worker of the host, the bucket's owner
(chosen from the bucket's name, so every host picks the same local rank and every bucket of a
step spreads over the host's workers), compresses that sum and exchanges it with the same local
rank on every other host (the pipeline's own exchange, error feedback and all, in the cross-host
process set); it then gives the result to the other workers of its host (one broadcast per dtype).
A host's link carries one compressed copy per bucket, whatever its number of workers, where
compressing on every worker would carry one per worker. The same scheme as Horovod's hierarchical
allreduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``) and as BytePS and CGX place compression.

One verdict for the step: every worker of a host holds every local sum, so each computes whether
any is not finite, and one allreduce of that flag across the hosts gives every worker the step's
verdict, which the owners' exchanges then obey (their state writes dropped, their results NaN).
A 4-byte allreduce of all workers closes the step, so that no worker leaves it (or the job) while
another host is still sharing its results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from grace.bucketing import bucket_tag
from grace.collectives import Collectives
from grace.compressor import stable_seed
from grace.ops import Ops, Tensor
from grace.packing import pack_sums, unpack_sums


def host_groups(group: Collectives) -> tuple[Collectives, Collectives]:
    """(the workers of this worker's host, the workers of the same local rank on every host)."""
    hosts = getattr(group, "hosts", None)
    if hosts is None:
        raise ValueError(f"hierarchical=True needs collectives that know the hosts (Horovod's local "
                         f"and cross ranks); {type(group).__name__} does not")
    return hosts()


def owner_of(tag: str, local_size: int) -> int:
    """The local rank that compresses the bucket named ``tag``: the same on every host."""
    return stable_seed("owner", tag) % local_size


@dataclass
class HostExchange:
    """A bucket between ``start`` and ``finish``: its local sums, and the owner's exchange."""

    tag: str
    sums: list  # the bucket's tensors summed over the host's workers
    owner: int
    inner: Any  # the owner's Exchange among the hosts, None on the host's other workers
    ops: Ops
    single: bool = False


def _start_joined(tensors: Sequence[Tensor], start_one: Callable, ops: Ops) -> tuple:
    """``tensors`` into one collective per dtype (``start_one(buffer, k)`` starts the one of
    buffer ``k``); ``_joined`` waits for them."""
    buffers, layout = pack_sums([(i, ops.flatten(t)) for i, t in enumerate(tensors)], None, ops)
    return [start_one(b, k) for k, b in enumerate(buffers)], layout, [ops.shape(t) for t in tensors]


def _joined(started: tuple, group: Collectives, ops: Ops) -> list:
    """The tensors of ``_start_joined`` as the collectives of ``group`` gave them back, in their
    shapes."""
    handles, layout, shapes = started
    parts, _ = unpack_sums([group.synchronize(h) for h in handles], layout, ops)
    return [ops.reshape(parts[i], shape) for i, shape in enumerate(shapes)]


def start(tensors: Sequence[Tensor], names: Sequence[str], group: Collectives, ops: Ops,
          start_flat: Callable, count: Callable) -> HostExchange:
    """Sum the bucket within the host, and start its exchange among the hosts on its owner
    (``start_flat(tensors, names, group, ops)``: the pipeline's own); ``count(nbytes)`` counts the
    bytes this worker put into the host's sum."""
    local, cross = host_groups(group)
    tag = bucket_tag(names)
    sums = list(tensors)
    if local.size > 1:
        sums = _joined(_start_joined(sums, lambda b, k: local.allreduce_async(b, f"{tag}.host{k}"),
                                     ops), local, ops)
        count(sum(ops.nbytes(t) for t in tensors))
    owner = owner_of(tag, local.size)
    inner = None
    if cross.size > 1 and local.rank == owner:
        inner = start_flat(sums, list(names), cross, ops)
    return HostExchange(tag, sums, owner, inner, ops)


def finish(exchanges: Sequence[HostExchange], group: Collectives, scale: float, carried: list,
           finish_flat: Callable, count: Callable) -> list:
    """The step's results on every worker: the owners finish their exchanges among the hosts
    under the step's one verdict, and share the results within their hosts; ``count(nbytes)``
    counts the verdict's flag as control bytes."""
    local, cross = host_groups(group)
    ops = exchanges[0].ops
    flag = None
    for exchange in exchanges:
        for t in exchange.sums:
            f = ops.nonfinite_flag(t)
            flag = f if flag is None else ops.maximum(flag, f)
    for t in carried:
        flag = ops.maximum(flag, ops.nonfinite_flag(t))
    if cross.size > 1:
        count(ops.nbytes(flag))
        flag = cross.synchronize(cross.allreduce_async(flag, "grace.hosts.verdict"))
    poisoned = ops.nan_if(ops.is_set(flag), ops.zeros(1, "float32", like=flag))
    owned = [e for e in exchanges if e.inner is not None]
    finished = iter(finish_flat([e.inner for e in owned], cross, scale, [poisoned]) if owned else [])
    if cross.size == 1:  # one host: nothing to compress between hosts
        mine = [[ops.nan_if(ops.is_set(flag), ops.scale(t, scale) if scale != 1.0 else t)
                 for t in exchange.sums] for exchange in exchanges]
    else:
        owners = [next(finished) if exchange.inner is not None else None for exchange in exchanges]
        if local.size == 1:  # every worker owns its buckets
            mine = [list(r) for r in owners]
        else:  # every bucket's results start back into the hosts before any is waited for
            started = [_share(exchange, r, local, ops) for exchange, r in zip(exchanges, owners)]
            mine = [_joined(s, local, ops) for s in started]
    results = [m[0] if exchange.single else m for exchange, m in zip(exchanges, mine)]
    if local.size > 1 and cross.size > 1:
        # The step's last operations ran within the hosts. A worker that left the step now could
        # leave the job while another host still shares its results, and Horovod shuts every
        # process set down when one worker ends: one 4-byte allreduce of all workers closes the
        # step together.
        count(4)
        group.synchronize(group.allreduce_async(ops.zeros(1, "float32", like=flag), "grace.hosts.done"))
    return results


def _share(exchange: HostExchange, results: Any, local: Collectives, ops: Ops) -> tuple:
    """The owner's results of one bucket started back to every worker of its host (a broadcast
    per dtype, for ``_joined``); ``results`` is None on the host's other workers."""
    tensors = results if results is not None else exchange.sums  # the others receive into these
    return _start_joined(tensors, lambda b, k: local.broadcast_async(
        b, exchange.owner, f"{exchange.tag}.shared{k}"), ops)
