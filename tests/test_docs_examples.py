"""The user-facing examples of docs/tensorflow.md, run as written on 2 real Horovod workers
(tests/workers/docs_examples.py): each must run, send compressed gradients, and leave both workers
with the same weights. Each worker starts from its own random weights (its own Keras seed) and
trains on its own data, so equal weights need the broadcast and the averaging to work; the TF1
example, without a broadcast, starts alike and must move."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from tests.launch import ROOT, horovodrun

PAGE = os.path.join(ROOT, "docs", "tensorflow.md")


def test_every_tensorflow_page_example_runs_and_leaves_the_workers_alike(tmp_path):
    horovodrun(os.path.join(ROOT, "tests", "workers", "docs_examples.py"), PAGE, str(tmp_path))
    with open(PAGE) as f:
        count = len(re.findall(r"^```python\n", f.read(), re.M))
    assert count == 4  # the tape, the TF1 optimizer, model.fit, a compressor on TF tensors
    for rank in range(2):
        assert json.loads((tmp_path / f"ran.rank{rank}.json").read_text())["examples"] == count
    trained = 0
    for i in range(count):
        arrays = [np.load(tmp_path / f"example{i}.rank{rank}.npz") for rank in range(2)]
        assert sorted(arrays[0].files) == sorted(arrays[1].files)
        for name in arrays[0].files:
            assert np.isfinite(arrays[0][name]).all()
            np.testing.assert_array_equal(arrays[0][name], arrays[1][name])
        trained += bool(arrays[0].files)
        stats = json.loads((tmp_path / f"example{i}.rank0.json").read_text())["stats"]
        if i in (0, 2):  # the tape and model.fit, grace.topk(0.01): far below the dense bytes
            assert 0 < stats["bytes_sent"] < 0.2 * stats["bytes_dense"]
    assert trained == 3  # every example but the inspection left weights to compare
    w = np.load(tmp_path / "example1.rank0.npz")["arr_0"]
    assert np.abs(w - 0.1).max() > 1e-3  # the TF1 example's weights moved from their start
