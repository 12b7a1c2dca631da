"""grace's DDP hook under PyTorch Lightning (``grace.LightningCommHook``), on real workers
(``torchrun``, Gloo, Lightning's ``DDPStrategy`` on the CPU, tests/workers/lightning_train.py):
the trained weights against the numpy model of top-k with error feedback, the bytes counted, a
resume from Lightning's checkpoint bit for bit, Lightning's own hook argument left unused on the
CPU (why the callback exists), and the errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import grace
from tests import reference
from tests.test_ddp import TOPK_BYTES, torchrun
from tests.test_horovod_torch import check, load

WORKER = os.path.join("tests", "workers", "lightning_train.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    torchrun(out, worker=WORKER)
    return out


def test_the_callback_compresses_as_the_ddp_hook_does(run):
    """Ten steps of the linear model under ``Trainer(strategy=DDPStrategy(),
    callbacks=[grace.LightningCommHook(grace.topk(0.05))])``: the numpy model of top-k with error
    feedback averaged over two workers, the same on both, with top-k's bytes."""
    infos = check(run, "callback_topk", reference.simulate(reference.topk_with_residual(0.05)))
    assert infos[0]["stats"]["bytes_sent"] == TOPK_BYTES and infos[0]["stats"]["tensors"] == 20
    # The state is named as the LightningModule names its parameters (b travels dense: no residual).
    assert infos[0]["residuals"] == infos[1]["residuals"] == ["model.weight"]


def test_lightnings_own_hook_argument_is_left_unused_on_the_cpu(run):
    """``DDPStrategy(ddp_comm_state=grace.topk(0.05), ddp_comm_hook=grace.ddp_hook)`` on the CPU:
    Lightning registers no hook there, so the weights are plain averaging's and the compression
    sent nothing, which is what docs/ddp.md tells Lightning users and why the callback exists."""
    infos = check(run, "strategy_hook_on_cpu", reference.simulate())
    assert infos[0]["stats"]["bytes_sent"] == 0 and infos[0]["stats"]["tensors"] == 0


def test_a_fit_resumed_from_lightnings_checkpoint_continues_bit_for_bit(run):
    """Five steps, ``trainer.save_checkpoint``, then a new module, compression and trainer fitted
    from it to step ten: the weights and byte counts of ten uninterrupted steps, exactly; the
    checkpoint holds both workers' compression states (each its own residual)."""
    resumed, infos = load(run, "callback_resumed")
    straight, straight_infos = load(run, "callback_topk")
    for rank in range(2):
        np.testing.assert_array_equal(resumed[rank]["w"], straight[rank]["w"])
        np.testing.assert_array_equal(resumed[rank]["b"], straight[rank]["b"])
        assert infos[rank]["stats"] == straight_infos[rank]["stats"]
    assert infos[0]["saved_workers"] == 2


def test_a_second_hook_is_a_clear_error_on_every_worker(run):
    """A hook already on the DDP model (as DDPStrategy's on CUDA would be): every worker raises
    the ValueError that says to give the compression to the callback only."""
    for rank in range(2):
        said = json.loads((run / f"second_hook.rank{rank}.json").read_text())
        assert said["error"] is not None
        assert "give the grace compression to LightningCommHook only" in said["error"]
        assert said["cause"] == "RuntimeError"  # DDP's own, kept as the cause


def test_the_compression_is_checked_where_the_callback_is_built():
    with pytest.raises(TypeError, match="compression must be a grace pipeline"):
        grace.LightningCommHook("topk")


def test_a_trainer_without_ddp_is_refused_when_fitting_starts(tmp_path):
    """One process, one CPU device: Lightning's single-device strategy has no DDP model, and
    fitting stops before its first step with the error naming ``strategy='ddp'``."""
    import pytorch_lightning as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.steps = 0

        def training_step(self, batch, _):
            self.steps += 1
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2)

    module = Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[grace.LightningCommHook(grace.topk(0.05))])
    with pytest.raises(ValueError, match=r"give the Trainer strategy='ddp'.*SingleDeviceStrategy"):
        trainer.fit(module)
    assert module.steps == 0
