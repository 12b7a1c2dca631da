"""``grace.collectives.Collectives`` over ``torch.distributed``: the collectives of a process group
(Gloo, NCCL, MPI), for the DDP communication hook (``frameworks/torch/ddp.py``). No Horovod.

torch.distributed matches operations by their order, not by name: every worker must start the same
operations in the same order, which the pipeline does (a bucket's collectives in a fixed order, the
buckets in DDP's order). Two of grace's operations take more than one call here:

- **allgather of lengths that differ** (a payload whose size depends on the data): the lengths are
  gathered first (8 bytes a worker, waited for), then every worker's tensor padded to the longest;
  the padding is cut off on arrival. Where every payload has a fixed size, the pipeline says so
  (``allgather_equal_async``) and one ``all_gather`` does.
- **alltoall**: the splits are exchanged first (waited for), so that each worker knows what it
  receives; then ``all_to_all_single``.

Tensors are reduced in place only where the pipeline gives them over
(``allreduce_given_async``): it may hold on to what it sent.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grace.collectives import Solo


@dataclass
class _Pending:
    """An operation in flight: its ``Work`` (``None`` when already done) and how to make the
    result from what it filled in."""

    work: Any
    finish: Any

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


class DistributedCollectives:
    """The collectives of one ``torch.distributed`` process group (the default group when
    ``group`` is ``None``)."""

    def __init__(self, group: Any = None, weak: bool = False):
        # A group grace made itself (``hosts``) is held weakly: PyTorch holds it until
        # ``destroy_process_group()``, and a reference of grace's that outlived that (through a
        # model's reference cycles, until the interpreter's exit) tore the group down after Gloo's
        # own teardown, which aborted about one worker in twenty at exit.
        self._group = weakref.ref(group) if weak and group is not None else (lambda: group)
        self._hosts: tuple | None = None

    @property
    def group(self) -> Any:
        return self._group()

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's worker ``rank``."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> _Pending:
        return self.allreduce_given_async(tensor.clone(), name)

    def allreduce_given_async(self, tensor: torch.Tensor, name: str) -> _Pending:
        """The sum written into ``tensor`` itself: the caller reads it no more."""
        return _Pending(dist.all_reduce(tensor, group=self.group, async_op=True), lambda: tensor)

    def allgather_async(self, tensor: torch.Tensor, name: str) -> _Pending:
        flat = tensor.reshape(-1)
        lengths = self._gather_lengths(flat.numel(), flat.device)
        longest = max(lengths)
        padded = flat if flat.numel() == longest else torch.cat(
            [flat, flat.new_zeros(longest - flat.numel())])
        parts = [flat.new_empty(longest) for _ in lengths]
        work = dist.all_gather(parts, padded.contiguous(), group=self.group, async_op=True)
        return _Pending(work, lambda: torch.cat([p[:n] for p, n in zip(parts, lengths)]))

    def allgather_equal_async(self, tensor: torch.Tensor, name: str) -> _Pending:
        """``allgather_async`` where every worker's tensor is as long as this one (the pipeline
        knows when: no part of the payload varies), without exchanging the lengths: no wait."""
        flat = tensor.reshape(-1).contiguous()
        parts = [torch.empty_like(flat) for _ in range(self.size)]
        work = dist.all_gather(parts, flat, group=self.group, async_op=True)
        return _Pending(work, lambda: torch.cat(parts))

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> _Pending:
        out = tensor.clone()
        work = dist.broadcast(out, src=self.global_rank(root), group=self.group, async_op=True)
        return _Pending(work, lambda: out)

    def alltoall_async(self, tensor: torch.Tensor, splits: torch.Tensor, name: str) -> _Pending:
        send = [int(s) for s in splits.reshape(-1).tolist()]
        sizes = torch.tensor(send, dtype=torch.int64, device=tensor.device)
        received = torch.empty_like(sizes)
        dist.all_to_all_single(received, sizes, group=self.group)
        receive = [int(s) for s in received.tolist()]
        out = tensor.new_empty(sum(receive))
        work = dist.all_to_all_single(out, tensor.reshape(-1).contiguous(), receive, send,
                                      group=self.group, async_op=True)
        return _Pending(work, lambda: out)

    def synchronize(self, handle: _Pending) -> torch.Tensor:
        return handle.wait()

    def _gather_lengths(self, numel: int, device: torch.device) -> list[int]:
        mine = torch.tensor([numel], dtype=torch.int64, device=device)
        lengths = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(lengths, mine, group=self.group)
        return [int(n.item()) for n in lengths]

    def hosts(self) -> tuple:
        """(the workers of this worker's host, the workers of its local rank on every host), as
        collectives of subgroups (``hierarchical=True``), made once; a group of one is a ``Solo``.
        torchrun numbers the workers host after host (``rank = host * LOCAL_WORLD_SIZE +
        LOCAL_RANK``), which this needs, with the same number of workers on every host."""
        if self._hosts is None:
            self._hosts = _host_groups(self)
        return self._hosts


def _host_groups(collectives: DistributedCollectives) -> tuple:
    if collectives.group is not None:
        raise ValueError("hierarchical=True groups the workers by host within the whole job: use "
                         "it with the default process group")
    size, rank = dist.get_world_size(), dist.get_rank()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    if per_host < 1 or local_rank < 0:
        raise ValueError("hierarchical=True needs LOCAL_WORLD_SIZE and LOCAL_RANK in the "
                         "environment, as torchrun sets them")
    if size % per_host:
        raise ValueError(f"hierarchical=True needs the same number of workers on every host; "
                         f"{per_host} per host does not divide the job's {size}")
    if rank != (rank // per_host) * per_host + local_rank:
        raise ValueError(f"hierarchical=True needs the workers placed host after host (rank = "
                         f"host x {per_host} + local rank); rank {rank} is local rank {local_rank}")
    hosts = size // per_host
    groups = ([list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
              + [list(range(local, size, per_host)) for local in range(per_host)])
    made = {}
    for ranks in groups:  # every worker makes every group, in the same order, as PyTorch requires
        key = tuple(ranks)
        if key not in made:
            made[key] = (None if len(ranks) == size else
                         dist.new_group(ranks) if len(ranks) > 1 else "solo")
    mine = (tuple(groups[rank // per_host]), tuple(groups[hosts + local_rank]))

    def collectives_of(key):
        group = made[key]
        return Solo() if group == "solo" else DistributedCollectives(group, weak=True)
    return collectives_of(mine[0]), collectives_of(mine[1])
