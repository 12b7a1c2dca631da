"""The descriptions workers exchange at construction, and the sentences that name their differences."""

from __future__ import annotations

import pytest

import grace
from grace import agreement


def test_identical_workers_agree():
    a = agreement.describe(grace.topk(0.01), [("w", (3, 4), "float32")], op="Average")
    b = agreement.describe(grace.topk(0.01), [("w", (3, 4), "float32")], op="Average")
    assert agreement.disagreements([a, b, a]) == []
    agreement.check([a, b])


def test_every_difference_is_named():
    base = agreement.describe(grace.topk(0.01), [("w", (3, 4), "float32"), ("b", (3,), "float32")],
                              op="Average")
    other = agreement.describe(grace.qsgd(3), [("w", (3, 5), "float32"), ("c", (2,), "float32")],
                               op="Sum")
    problems = agreement.disagreements([base, base, other])
    assert problems[0].startswith("worker 0 compresses with Pipeline(compressor=TopK(ratio=0.01)")
    assert problems[0].endswith("but worker 2 with " + repr(grace.qsgd(3)))
    assert "op is 'Average' on worker 0 but 'Sum' on worker 2" in problems
    assert "tensor 'b' exists on worker 0 but not on worker 2" in problems
    assert "tensor 'c' exists on worker 2 but not on worker 0" in problems
    assert "tensor 'w' is float32 [3, 4] on worker 0 but float32 [3, 5] on worker 2" in problems
    with pytest.raises(ValueError, match="the workers are not set up alike"):
        agreement.check([base, other])
