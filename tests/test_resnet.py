"""The end-to-end workload's ResNet-50 (scripts/resnet.py, torchvision's definition, which cannot be
installed beside the pinned CPU build of torch) and the comparison's figures built on it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scripts import compare, workloads


def test_the_model_has_torchvisions_resnet50_parameters_in_their_order():
    """The same 161 tensors, shapes and order as torchvision's ``resnet50()`` (listed by hand in
    ``workloads.resnet50_shapes`` from torchvision's definition: 25,557,032 parameters), so that
    the gradients the workload exchanges are those of the model users train."""
    from scripts.resnet import ResNet50

    model = ResNet50()
    got = [tuple(p.shape) for p in model.parameters()]
    want = [shape for _, shape in workloads.resnet50_shapes()]
    assert len(got) == 161
    assert got == want
    assert sum(math.prod(s) for s in got) == 25_557_032
    # torchvision's names, written out from its definition: stem, then per bottleneck conv1-3 and
    # bn1-3, the first block of each stage with a downsample (a strided 1x1 conv and a batch norm).
    want_names = ["conv1.weight", "bn1.weight", "bn1.bias"]
    for stage, blocks in enumerate((3, 4, 6, 3), start=1):
        for block in range(blocks):
            for i in (1, 2, 3):
                want_names += [f"layer{stage}.{block}.conv{i}.weight",
                               f"layer{stage}.{block}.bn{i}.weight", f"layer{stage}.{block}.bn{i}.bias"]
            if block == 0:
                want_names += [f"layer{stage}.0.downsample.0.weight",
                               f"layer{stage}.0.downsample.1.weight", f"layer{stage}.0.downsample.1.bias"]
    want_names += ["fc.weight", "fc.bias"]
    assert [name for name, _ in model.named_parameters()] == want_names
    # 161 parameters and 3 buffers (running mean, variance, batch count) for each of 53 batch norms
    assert len(model.state_dict()) == 161 + 3 * 53


def test_the_model_downsamples_as_torchvision_v1_5_and_trains():
    """Stride on the 3x3 convolution (torchvision's v1.5): a 64x64 image leaves the last stage at
    2x2; He-normal fan-out weights; a few SGD steps on one fixed batch lower its loss (a model
    whose backward did not reach every layer would not fit 4 images)."""
    import torch

    from scripts.resnet import ResNet50

    torch.manual_seed(0)
    model = ResNet50(classes=10)
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)
    features = {}

    def seen(module, inputs, output):
        features["shape"] = tuple(output.shape)

    model.layer4.register_forward_hook(seen)
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 3])
    model(x)
    assert features["shape"] == (4, 2048, 2, 2)
    # He-normal in fan-out mode: the stem's 7x7 conv has fan-out 64 * 49 = 3136 (fan-in 147 would
    # give a std 4.6 times larger); 9,408 samples: the std within 3%.
    w = model.conv1.weight.detach()
    assert float(w.std()) == pytest.approx(math.sqrt(2.0 / 3136), rel=0.03)
    # The shortcut: with its last batch norm at zero, a bottleneck gives relu(its input).
    block = model.layer1[1]
    with torch.no_grad():
        block.bn3.weight.zero_()
        block.bn3.bias.zero_()
        z = torch.randn(2, 256, 8, 8)
        np.testing.assert_array_equal(block(z).numpy(), torch.relu(z).numpy())
    torch.manual_seed(0)
    model = ResNet50(classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0], losses


def run(compression, rate, workers, samples, repeat, compute=0.3, status="ok"):
    row = {"workload": "resnet50", "framework": "torch", "compression": compression, "rate": rate,
           "workers": workers, "status": status, "repeat": repeat, "optimizer": "sgd"}
    if status == "ok":
        step = 16 * workers / samples
        row.update(samples_per_s=samples, step_s=step, compute_s=compute, compression_s=0.01,
                   communication_s=step - compute - 0.01, bytes_per_step=1.0,
                   epochs=[{"epoch": 1, "step_s": step, "train_wall_s": 1.0}])
    return row


def test_repeats_become_their_medians_and_efficiency_is_against_one_worker_alone():
    """Three interleaved repeats of a set-up give one row of their medians (samples/s and each
    part of the step separately), every repeat's samples/s kept; ``of_alone`` is samples/s per
    worker over the one-worker run's, ``of_compute`` the step's compute over the step."""
    runs = [run("fp32", compare.ALONE, 1, s, i) for i, s in enumerate([50.0, 40.0, 45.0])]
    # The repeat with the median samples/s (30) is not the one with the median compute (0.40):
    # each figure is its own median.
    runs += [run("fp32", "1gbit", 2, s, i, compute=c)
             for i, (s, c) in enumerate([(30.0, 0.44), (36.0, 0.38), (27.0, 0.40)])]
    runs += [run("fp32", "1gbit", 2, 0, 3, status="failed: timeout")]
    rows = compare.medians(runs)
    assert len(rows) == 2
    alone, two = rows
    assert alone["samples_per_s"] == 45.0 and alone["repeats"] == [50.0, 40.0, 45.0]
    assert two["samples_per_s"] == 30.0 and two["compute_s"] == pytest.approx(0.40)
    assert two["failed_repeats"] == 1
    assert two["step_s"] == pytest.approx(np.median([32 / 30, 32 / 36, 32 / 27]))
    flat = compare.flatten(two, compare.alone_limits(rows))
    assert flat["of_alone"] == 0.333  # 15 per worker against 45 alone
    assert flat["of_compute"] == round(0.40 / (32 / 30), 3) == 0.375
    assert flat["repeats"] == 3
    assert compare.flatten(two)["of_alone"] == ""  # no one-worker run: no efficiency claimed


def test_a_set_up_whose_every_repeat_failed_stays_a_failed_row(tmp_path):
    runs = [run("fp32", compare.ALONE, 1, 45.0, 0),
            run("fp32", "1gbit", 2, 0, 0, status="failed: boom"),
            run("fp32", "1gbit", 2, 0, 1, status="failed: again"),
            run('{"compressor": "topk", "ratio": 0.01}', "1gbit", 2, 60.0, 0)]
    rows = compare.medians(runs)
    assert rows[1]["status"] == "failed: boom"
    compare.write_outputs(runs, str(tmp_path), 0.0)
    table = (tmp_path / "results.md").read_text()
    assert "| torch | fp32 | 1gbit | 2 | failed: boom |" in table
    import json

    assert len(json.loads((tmp_path / "results.json").read_text())) == 4  # every repeat kept
    summary = (tmp_path / "end_to_end.md").read_text()
    # top-k: 30 per worker, 30/45 of alone, compute 0.3 s of a 16*2/60 s step; 10 ms compression.
    assert "| topk(ratio=0.01) | 30.0 | 0.67 | 0.56 | 300 | 10 | 223 |" in summary
    assert "| fp32 | failed |  |  |  |  |  |" in summary  # a failed set-up has no figures
    assert (tmp_path / "of_alone.png").stat().st_size > 0
