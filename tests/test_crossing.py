"""``scripts/studies/crossing.py``: TensorFlow's exchange step traced with grace's loops crossing into the
host from several sizes, timed in turns within one real Horovod worker."""

from __future__ import annotations

import json
import os

import pytest

from tests.launch import ROOT, horovodrun

# Minutes long: in `make test-slow` and CI, not in `make test` (Makefile).
pytestmark = pytest.mark.slow


def test_each_crossing_gets_its_own_traced_step_and_a_paired_ratio(tmp_path):
    """ResNet-50's first 37 shapes hold one tensor of 2¹⁶-2¹⁸ elements (the last): from 2¹⁶ its
    compression runs grace's loops instead of TensorFlow's composite code, so that step traces
    fewer operations. Each ratio is to the first crossing of its round."""
    out = tmp_path / "crossing.json"
    text = horovodrun(os.path.join(ROOT, "scripts", "studies", "crossing.py"), "--compression", "efsignsgd",
                      "--crossings", "262144,65536", "--rounds", "3", "--steps", "1",
                      "--layers", "37", "--out", str(out), np=1, timeout=300)
    result = json.loads(out.read_text())
    first, lower = result["rows"]
    assert [r["crossing"] for r in result["rows"]] == [262144, 65536]
    assert first["traced_ops"] > lower["traced_ops"]  # the loops replace several operations
    assert first["ratio"] == first["ratio_q1"] == first["ratio_q3"] == 1.0
    assert all(r["ratio_q1"] <= r["ratio"] <= r["ratio_q3"] and r["step_ms"] > 0 for r in result["rows"])
    assert (result["workers"], result["rounds"], result["layers"]) == (1, 3, 37)
    assert "| from 65536 elements |" in text
