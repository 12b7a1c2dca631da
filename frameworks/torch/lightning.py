"""grace's DDP communication hook under PyTorch Lightning, on every accelerator.

    trainer = Trainer(strategy="ddp", callbacks=[grace.LightningCommHook(grace.topk(0.01))])

Lightning's own way, ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=grace.ddp_hook)``, registers
the hook only where the model runs on CUDA (``DDPStrategy._register_ddp_hooks``, pytorch_lightning
2.6): on the CPU, Gloo, it leaves DDP's uncompressed allreduce in place and says nothing. This
callback registers ``grace.ddp_hook`` on the DDP model the strategy made, whatever the
accelerator, when fitting starts, with the compression state named as the LightningModule names
its parameters; and it keeps every worker's compression state in Lightning's checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from frameworks.torch.ddp import DDPState, ddp_hook
from grace.pipeline import Pipeline

try:  # the standalone package, then the unified one
    from pytorch_lightning import Callback
except ImportError:  # pragma: no cover - where only ``lightning`` is installed
    from lightning.pytorch import Callback


class LightningCommHook(Callback):
    """A Lightning callback that compresses DDP's gradient exchange with ``compression`` (a grace
    pipeline, e.g. ``grace.topk(0.01)``), as ``ddp.register_comm_hook(compression,
    grace.ddp_hook)`` does for a DDP model of one's own (docs/ddp.md).

    At ``on_fit_start`` (the strategy has wrapped the model in ``DistributedDataParallel``) it
    registers the hook, its state named by the LightningModule's ``named_parameters()``. A trainer
    whose strategy is not DDP, or a DDP model that already has a hook (given to ``DDPStrategy``
    too), is a ``ValueError`` there. Its ``state_dict()``, which Lightning calls on every worker
    when it saves a checkpoint, gathers every worker's compression state (residuals, momenta,
    counters: each worker's own); ``load_state_dict()`` takes this worker's back, so that a run
    resumed with ``trainer.fit(..., ckpt_path=...)`` continues bit for bit. The checkpoint grows by
    the workers' count times the state of one (top-k's residual: one model's size per worker)."""

    def __init__(self, compression: Pipeline) -> None:
        if not isinstance(compression, Pipeline):
            raise TypeError(f"compression must be a grace pipeline such as grace.topk(0.01), got "
                            f"{type(compression).__name__}")
        self.compression = compression
        self.ddp_state: DDPState | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            raise ValueError(f"LightningCommHook compresses DDP's exchange: give the Trainer "
                             f"strategy='ddp' (or a DDPStrategy); its strategy is "
                             f"{type(trainer.strategy).__name__}, whose model is "
                             f"{type(ddp).__name__}")
        if self.ddp_state is None:
            group = None if ddp.process_group == dist.group.WORLD else ddp.process_group
            self.ddp_state = DDPState(self.compression, process_group=group,
                                      named_parameters=pl_module.named_parameters())
        try:
            ddp.register_comm_hook(self.ddp_state, ddp_hook)
        except RuntimeError as error:  # DDP takes one hook per model
            raise ValueError("this DDP model already has a communication hook: give the grace "
                             "compression to LightningCommHook only, not to DDPStrategy("
                             "ddp_comm_hook=...) as well") from error

    def state_dict(self) -> dict[str, Any]:
        # Lightning writes the checkpoint from rank 0, and calls this on every worker first:
        # each worker's state travels to all, so that rank 0's file holds them all.
        _, size = _rank_and_size()
        workers: list = [self.compression.state_dict()] * size
        if size > 1:
            dist.all_gather_object(workers, workers[0])
        return {"workers": workers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        workers = state_dict["workers"]
        rank, size = _rank_and_size()
        if len(workers) != size:
            raise ValueError(f"this checkpoint holds the compression state of {len(workers)} "
                             f"workers and this job has {size}: resume with as many workers")
        self.compression.load_state_dict(workers[rank])


def _rank_and_size() -> tuple[int, int]:
    """This worker's rank and the job's size in the default process group (0 and 1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
