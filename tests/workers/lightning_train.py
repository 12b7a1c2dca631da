"""Worker for tests/test_lightning.py: trains the linear model of the DDP tests as a PyTorch
Lightning module (``Trainer(strategy=DDPStrategy(...))`` on the CPU, Gloo) and saves each rank's
final weights and compression stats.

Run by ``torchrun --nproc_per_node=2 tests/workers/lightning_train.py OUTDIR``: Lightning finds
torchrun's environment and starts no processes of its own."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

import grace
from tests.workers.common import LR, batch, torch_linear

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
args = parser.parse_args()
torch.set_num_threads(1)
STEPS = 10


class Linear(pl.LightningModule):
    """The DDP tests' linear model; step ``s`` trains on this rank's batch ``s`` (from the trainer's
    step count, so that a resumed run meets the same batches whatever its loader did)."""

    def __init__(self):
        super().__init__()
        self.model = torch_linear(0)

    def forward(self, x):
        return self.model(x)

    def training_step(self, _, __):
        x, y = (torch.from_numpy(a) for a in batch(self.global_rank, self.global_step))
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(STEPS), batch_size=None)


def trainer(steps: int, strategy: DDPStrategy | None = None, callbacks=()) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy or DDPStrategy(),
                      max_steps=steps, callbacks=list(callbacks), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False)


def save(name: str, module: Linear, compression, **info) -> None:
    rank = module.global_rank
    weights = {"w": module.model.weight, "b": module.model.bias}
    np.savez(os.path.join(args.outdir, f"{name}.rank{rank}.npz"),
             **{k: v.detach().double().numpy() for k, v in weights.items()})
    with open(os.path.join(args.outdir, f"{name}.rank{rank}.json"), "w") as f:
        json.dump({"stats": compression.stats(), **info}, f)


def callback_topk():
    compression = grace.topk(0.05)
    module = Linear()
    trainer(STEPS, callbacks=[grace.LightningCommHook(compression)]).fit(module)
    save("callback_topk", module, compression,
         residuals=sorted(compression.state_dict()["memory"]["residuals"]))


def strategy_hook_on_cpu():
    """Lightning's own way to give a hook, which it registers on CUDA only."""
    compression = grace.topk(0.05)
    module = Linear()
    strategy = DDPStrategy(ddp_comm_state=compression, ddp_comm_hook=grace.ddp_hook)
    trainer(STEPS, strategy=strategy).fit(module)
    save("strategy_hook_on_cpu", module, compression)


def callback_resumed():
    """Five steps and a checkpoint; then a new module, compression and trainer resumed from it."""
    path = os.path.join(args.outdir, "half.ckpt")
    first = trainer(STEPS // 2, callbacks=[grace.LightningCommHook(grace.topk(0.05))])
    first.fit(Linear())
    first.save_checkpoint(path)  # every worker calls it; rank 0 writes
    compression = grace.topk(0.05)
    module = Linear()
    trainer(STEPS, callbacks=[grace.LightningCommHook(compression)]).fit(module, ckpt_path=path)
    workers = torch.load(path, weights_only=False)["callbacks"]["LightningCommHook"]["workers"]
    save("callback_resumed", module, compression, saved_workers=len(workers))


class AllreduceHook(pl.Callback):
    """Registers PyTorch's plain allreduce hook first, as DDPStrategy(ddp_comm_hook=...) does on
    CUDA."""

    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)


def second_hook():
    """A hook already registered when the callback's turn comes: a ValueError that says what to
    do, on every worker (DDP's own error is its cause)."""
    try:
        trainer(STEPS, callbacks=[AllreduceHook(), grace.LightningCommHook(grace.topk(0.05))]).fit(Linear())
        said = cause = None
    except ValueError as error:
        said, cause = str(error), type(error.__cause__).__name__
    rank = int(os.environ["RANK"])
    with open(os.path.join(args.outdir, f"second_hook.rank{rank}.json"), "w") as f:
        json.dump({"error": said, "cause": cause}, f)


for scenario in (callback_topk, strategy_hook_on_cpu, callback_resumed, second_hook):
    scenario()
