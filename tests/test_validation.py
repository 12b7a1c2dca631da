"""Bad input fails at construction with a ValueError naming the parameter and what it accepts."""

from __future__ import annotations

import inspect
import math
import re

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
    allowed = ", ".join(grace.available())
    with pytest.raises(ValueError, match=re.escape(f"unknown compressor 'topkk' (did you mean 'topk'?); "
                                                   f"allowed: {allowed}")):
        grace.build("topkk")
    with pytest.raises(ValueError, match=r"unknown memory 'residul' \(did you mean 'residual'\?\)"):
        grace.topk(0.1, memory="residul")
    with pytest.raises(ValueError, match=r"unknown communicator 'allgater' \(did you mean "
                                         r"'allgather'\?\); allowed: allgather, allreduce, "
                                         r"alltoall, auto, broadcast"):
        grace.topk(0.1, communicator="allgater")


def test_topk_through_allreduce_is_refused():
    with pytest.raises(ValueError, match="communicator='allreduce' cannot carry 'topk'.*allgather"):
        grace.topk(0.01, communicator="allreduce")


def test_from_params_builds_the_same_pipeline():
    p = grace.from_params({"compressor": "topk", "ratio": 0.01, "memory": "momentum",
                           "communicator": "auto"})
    assert repr(p) == repr(grace.topk(0.01))
    assert repr(grace.from_params({"compressor": "randomk", "seed": 4})) == repr(grace.randomk(seed=4))


@pytest.mark.parametrize("params, message", [
    ({"compressor": "topk", "ratoi": 0.1}, r"unknown parameter 'ratoi'.*accepted: .*ratio"),
    ({"ratio": 0.1}, r"needs a 'compressor' key; one of: adaq, bf16, dgc, .*, topk, twobit, u8bit"),
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


@pytest.mark.parametrize("build, message", [
    (lambda: grace.qsgd(0), r"levels must be an int >= 1, got 0"),
    (lambda: grace.qsgd(2.5), r"levels must be an int >= 1, got 2.5"),
    (lambda: grace.powersgd(rank=0), r"rank must be an int >= 1, got 0"),
    (lambda: grace.sketch(1), r"bins must be an int >= 2, got 1"),
    (lambda: grace.sketch(300), r"bins must be in \[2, 256\]"),
    (lambda: grace.signum(beta=1.0), r"beta must be in \[0, 1\), got 1.0"),
    (lambda: grace.dgc(0.001, momentum=1.5), r"momentum must be in \[0, 1\), got 1.5"),
    (lambda: grace.dgc(0.001, clip_norm=-1), r"clip_norm must be a number > 0 or None, got -1"),
    (lambda: grace.dgc(0.001, sample_ratio=0), r"sample_ratio must be in \(0, 1\], got 0"),
    (lambda: grace.dgc(2), r"ratio must be in \(0, 1\], got 2"),
    (lambda: grace.dgc(0.01, sparsity_warmup_steps=-1), r"sparsity_warmup_steps must be an int >= 0, got -1"),
    (lambda: grace.topk(0.01, warmup_steps=-1), r"warmup_steps must be an int >= 0, got -1"),
    (lambda: grace.threshold(0), r"threshold must be a finite number > 0, got 0"),
    (lambda: grace.threshold(math.inf), r"threshold must be a finite number > 0, got inf"),
    (lambda: grace.inceptionn(-1.0), r"error_bound must be a finite number > 0, got -1.0"),
    (lambda: grace.adaq(0.0), r"ratio must be in \(0, 1\], got 0.0"),
    (lambda: grace.terngrad(seed=-2), r"seed must be an int >= 0, got -2"),
    (lambda: grace.natural(seed="a"), r"seed must be an int >= 0, got 'a'"),
    (lambda: grace.randomk(take_adam_moments="no"), r"take_adam_moments must be True or False, got 'no'"),
])
def test_catalogue_parameters_are_checked_at_construction(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_memory_parameters_belong_to_their_memory():
    assert grace.dgc(0.01, momentum=0.5).memory.momentum == 0.5
    assert grace.topk(0.01, momentum=0.5).memory.momentum == 0.5
    with pytest.raises(ValueError, match=r"unknown parameter 'momentum' for compressor 'topk' with "
                                         r"memory 'residual'"):
        grace.topk(0.01, memory="residual", momentum=0.5)
    p = grace.from_params({"compressor": "dgc", "ratio": 0.01, "momentum": 0.8, "clip_norm": 2.0})
    assert (p.memory.momentum, p.memory.clip_norm, p.compressor.ratio) == (0.8, 2.0, 0.01)


@pytest.mark.parametrize("communicator", ["allreduce"])
@pytest.mark.parametrize("name", ["topk", "threshold", "dgc", "qsgd", "terngrad", "onebit", "signsgd",
                                  "signum", "efsignsgd", "natural", "u8bit", "sketch", "adaq",
                                  "inceptionn", "bf16", "twobit"])
def test_payloads_that_cannot_be_summed_refuse_allreduce(name, communicator):
    with pytest.raises(ValueError, match=f"communicator='allreduce' cannot carry '{name}' payloads"):
        grace.build(name, communicator=communicator)


@pytest.mark.parametrize("name", ["threshold", "adaq", "inceptionn"])
def test_variable_size_payloads_refuse_broadcast(name):
    with pytest.raises(ValueError, match=f"communicator='broadcast' needs payloads of a size known in "
                                         f"advance, and '{name}' payloads vary"):
        grace.build(name, communicator="broadcast")


@pytest.mark.parametrize("name", grace.available())
def test_each_factory_takes_its_compressors_parameters_and_defaults(name):
    """``grace.<name>`` is built from the class: the same parameters and defaults, in order, then
    ``build``'s options; positional arguments fill the parameters in that order."""
    factory = getattr(grace, name)
    params = list(inspect.signature(factory).parameters.values())
    assert [(p.name, p.default) for p in params[:-1]] == list(grace.compressor_params(name).items())
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    defaults = grace.build(name).compressor
    if params[:-1]:
        first = params[0]
        value = first.default if first.default is not None else 0.5
        assert repr(factory(value).compressor) == repr(grace.build(name, **{first.name: value}).compressor)
        with pytest.raises(TypeError, match="twice"):
            factory(value, **{first.name: value})
    assert repr(factory().compressor) == repr(defaults)
    with pytest.raises(TypeError, match="positional"):
        factory(*([0] * (len(params))))
