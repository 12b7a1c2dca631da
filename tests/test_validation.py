"""Bad input fails at construction with a ValueError naming the parameter and what it accepts."""

from __future__ import annotations

import math

import pytest

import grace


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, math.nan, math.inf, "0.1", True, None])
@pytest.mark.parametrize("factory", [grace.topk, grace.randomk])
def test_ratio_outside_unit_interval(factory, ratio):
    with pytest.raises(ValueError, match=r"ratio must be .*\(0, 1\]"):
        factory(ratio)


def test_ratio_one_is_allowed():
    assert grace.topk(1.0).compressor.ratio == 1.0


def test_unknown_names_suggest_the_closest():
    with pytest.raises(ValueError, match=r"unknown compressor 'topkk' \(did you mean 'topk'\?\); "
                                         r"allowed: fp16, none, randomk, topk"):
        grace.build("topkk")
    with pytest.raises(ValueError, match=r"unknown memory 'residul' \(did you mean 'residual'\?\)"):
        grace.topk(0.1, memory="residul")
    with pytest.raises(ValueError, match=r"unknown communicator 'allgater' \(did you mean "
                                         r"'allgather'\?\); allowed: allgather, allreduce, broadcast"):
        grace.topk(0.1, communicator="allgater")


def test_topk_through_allreduce_is_refused():
    with pytest.raises(ValueError, match="communicator='allreduce' cannot carry 'topk'.*allgather"):
        grace.topk(0.01, communicator="allreduce")


def test_from_params_builds_the_same_pipeline():
    p = grace.from_params({"compressor": "topk", "ratio": 0.01, "memory": "residual",
                           "communicator": "allgather"})
    assert repr(p) == repr(grace.topk(0.01))
    assert repr(grace.from_params({"compressor": "randomk", "seed": 4})) == repr(grace.randomk(seed=4))


@pytest.mark.parametrize("params, message", [
    ({"compressor": "topk", "ratoi": 0.1}, r"unknown parameter 'ratoi'.*accepted: .*ratio"),
    ({"ratio": 0.1}, r"needs a 'compressor' key; one of: fp16, none, randomk, topk"),
    ({"compressor": "topk", "ratio": 2}, r"ratio must be in \(0, 1\]"),
    ({"compressor": "randomk", "seed": -1}, r"seed must be an int >= 0"),
    ({"compressor": "topk", "min_numel": -5}, r"min_numel must be an int >= 0"),
])
def test_from_params_rejects(params, message):
    with pytest.raises(ValueError, match=message):
        grace.from_params(params)


def test_unknown_factory_keyword():
    with pytest.raises(ValueError, match=r"unknown parameter 'seed' for compressor 'topk'"):
        grace.topk(0.1, seed=3)


def test_available_lists_the_catalogue():
    assert {"none", "fp16", "topk", "randomk"} <= set(grace.available())
