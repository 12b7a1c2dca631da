"""What grace changes of what the user set, said (``Pipeline.notices``, the momentum takeovers, the
sign methods' learning rate), and the one switch that changes nothing (``keep_optimizer``): the
pipeline's side, in-process. The wrappers' side (one line, on rank 0 only) runs on real workers in
tests/test_momentum.py and tests/test_horovod_tensorflow.py."""

from __future__ import annotations

import os
import re

import pytest

import grace
from grace.compressor import MODELS
from grace.compressors.sign import LEARNING_RATE
from grace.momentum import OptimizerMomentum

SGD_09 = OptimizerMomentum(0.9, source="torch.optim.SGD's momentum")
SGD_0 = OptimizerMomentum(0.0, source="torch.optim.SGD's momentum")
MOMENTUM_OWNERS = ("dgc", "signum", "onebit", "twobit", "efsignsgd", "adaq", "randomk", "topk")


def departures(pipeline, *args, **kwargs) -> list[str]:
    """``pipeline.notices(...)`` but the line of the models it is measured short on
    (``shortfall_notice``, held by test_each_compressor_says_the_models_it_is_measured_short_on)."""
    return [line for line in pipeline.notices(*args, **kwargs)
            if line != pipeline.compressor.shortfall_notice()]


def test_randomk_says_its_floor_overrides_the_ratio_on_small_tensors():
    (line,) = departures(grace.randomk(0.01), 2)
    assert "min_kept=1024" in line and "102,400 elements" in line and "min_kept=1" in line
    assert departures(grace.randomk(0.01, min_kept=1), 2) == []


@pytest.mark.parametrize("name", ["topk", "qsgd", "onebit", "signsgd", "twobit"])
def test_auto_says_when_it_goes_through_the_owners(name):
    """From ALLTOALL_FROM (5) workers, where the owners keep what they round away and their second
    encoding is not measured short; not below, and not when the user named the communicator."""
    pipeline = grace.build(name)
    goes = pipeline.communicator.resolve(5) is not pipeline.communicator.resolve(4)
    lines = [line for line in departures(pipeline, 5) if "communicator='auto'" in line]
    assert len(lines) == int(goes)
    # QSGD has no memory; two-bit's owners are measured short (owners_caution): gathered at any size
    assert goes == (name not in ("qsgd", "twobit"))
    assert type(pipeline.communicator.resolve(64)).__name__ == ("Allgather" if not goes else "Alltoall")
    assert not [line for line in departures(pipeline, 4) if "communicator='auto'" in line]
    assert not [line for line in departures(grace.build(name, communicator="allgather"), 64)
                if "communicator" in line]


def test_twobit_named_through_the_owners_says_it_is_measured_short_there():
    """communicator='alltoall' is the user's to name; for two-bit, measured short through the owners,
    it says why and what gathers instead, on rank 0 once. Nothing for 1-bit, whose owners are not."""
    (line,) = departures(grace.build("twobit", communicator="alltoall"), 8)
    assert "twobit through the shards' owners" in line and "second two-bit encoding" in line
    assert "communicator='auto' or 'allgather' gathers" in line
    assert departures(grace.build("onebit", communicator="alltoall"), 8) == []


def test_nothing_to_say_for_a_compressor_that_changes_nothing():
    for name in ("none", "fp16", "threshold", "qsgd", "powersgd"):
        assert departures(grace.build(name), 2) == []
        assert departures(grace.build(name), 2, optimizer_seen=False) == []
    plain = grace.topk(memory="residual")  # plain error feedback owns no momentum
    assert departures(plain, 2) == departures(plain, 2, optimizer_seen=False) == []
    assert grace.topk(memory="residual").take_momentum(SGD_09) is None


@pytest.mark.parametrize("name", MOMENTUM_OWNERS)
def test_under_the_tape_every_momentum_owner_says_what_it_applies_or_needs(name):
    """DistributedGradientTape sees no optimizer: DGC and signum apply their default momentum
    themselves (an optimizer's would apply twice), 1-bit, two-bit, EF-signSGD, AdaQ and top-k
    need it given, and random-k needs the optimizer to have none. Said once; nothing where the
    user gave it."""
    lines = [line for line in departures(grace.build(name), 2, optimizer_seen=False)
             if "DistributedGradientTape" in line]
    assert len(lines) == 1
    if name in ("dgc", "signum"):
        assert "applies its own momentum" in lines[0] and "0.9" in lines[0]
    elif name == "randomk":
        assert "give the optimizer no momentum" in lines[0]
    else:
        assert f"pass {name}(momentum=0.9)" in lines[0]
    # Where the wrapper sees an optimizer it takes the momentum over (its own line), or none.
    assert not [line for line in departures(grace.build(name), 2) if "momentum" in line]


def test_an_explicit_momentum_is_not_announced_under_the_tape():
    assert not [line for line in departures(grace.dgc(momentum=0.5), 2, optimizer_seen=False)
                if "momentum" in line]
    assert not [line for line in departures(grace.signum(beta=0.8), 2, optimizer_seen=False)
                if "momentum" in line]


def test_signum_says_it_keeps_its_beta_over_an_optimizer_without_momentum():
    pipeline = grace.signum()
    assert pipeline.take_momentum(SGD_0) is None  # nothing taken
    (line,) = departures(pipeline, 2)
    assert "beta 0.9" in line and "torch.optim.SGD's momentum is 0" in line
    assert pipeline.compressor.beta == 0.9
    taking = grace.signum()
    assert "applies torch.optim.SGD's momentum (0.9)" in taking.take_momentum(SGD_09)
    assert departures(taking, 2) == []


def test_randomk_says_it_turns_momentum_off_on_the_tensors_it_compresses_only():
    line = grace.randomk(0.01).take_momentum(SGD_09)
    assert "off on the tensors it compresses" in line and "keep it" in line


@pytest.mark.parametrize("name", MOMENTUM_OWNERS)
def test_keep_optimizer_takes_nothing_over_and_adds_no_momentum(name):
    pipeline = grace.build(name, keep_optimizer=True)
    assert pipeline.take_momentum(SGD_09) is None
    assert pipeline.take_momentum(OptimizerMomentum(0.9, dampening=0.9), adam=True) is None
    assert pipeline.take_adam_moments(0.999, 1e-8) is None and not pipeline.adam_moments_taken
    owner = pipeline.memory if hasattr(pipeline.memory, "momentum_given") else pipeline.compressor
    assert owner.momentum == 0.0
    assert "keep_optimizer=True" in repr(pipeline)
    assert not [line for line in departures(pipeline, 2, optimizer_seen=False)
                if "DistributedGradientTape" in line]  # nothing to give or take: said apart


@pytest.mark.parametrize("name", ["dgc", "signum"])
def test_without_keep_optimizer_dgc_and_signum_take_the_momentum_over(name):
    """The control of the test above, where the default is not 0 already."""
    pipeline = grace.build(name)
    owner = pipeline.memory if hasattr(pipeline.memory, "momentum_given") else pipeline.compressor
    assert owner.momentum == 0.9
    assert pipeline.take_momentum(OptimizerMomentum(0.5)) is not None and owner.momentum == 0.5


def test_keep_optimizer_leaves_randomk_applying_the_optimizers_momentum():
    pipeline = grace.randomk(0.01, keep_optimizer=True)
    pipeline.take_momentum(SGD_09)
    assert pipeline.memory.turned_off == 0.0  # nothing turned off
    taking = grace.randomk(0.01)
    taking.take_momentum(SGD_09)
    assert taking.memory.turned_off == 0.9


@pytest.mark.parametrize("name, default", [("dgc", "momentum 0.9"), ("signum", "beta 0.9")])
def test_keep_optimizer_says_the_default_momentum_it_drops(name, default):
    (line,) = [line for line in departures(grace.build(name, keep_optimizer=True), 2)
               if "keep_optimizer=True" in line]
    assert f"applies none of its default momentum ({default})" in line
    assert not [line for line in departures(grace.onebit(keep_optimizer=True), 2)
                if "keep_optimizer" in line]  # its default is none: nothing dropped


def test_keep_optimizer_keeps_a_momentum_given_to_the_compression():
    pipeline = grace.dgc(momentum=0.5, keep_optimizer=True)
    assert pipeline.memory.momentum == 0.5
    assert pipeline.take_momentum(SGD_09) is None  # not taken, and no conflict raised


def test_without_keep_optimizer_randomk_takes_adams_moments_over():
    """The control of the test above: the same call does take them over by default."""
    assert grace.randomk(0.01).take_adam_moments(0.999, 1e-8) is not None


def test_keep_optimizer_is_validated_and_travels_in_params():
    with pytest.raises(ValueError, match="keep_optimizer"):
        grace.topk(0.01, keep_optimizer="yes")
    assert grace.from_params({"compressor": "dgc", "keep_optimizer": True}).keep_optimizer


@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_a_sign_method_says_when_the_learning_rate_is_far_above_what_it_needs(name):
    compressor = grace.build(name).compressor
    line = compressor.learning_rate_notice(0.1)
    assert "0.1 is 1,000 times what it needs" in line and f"use about {LEARNING_RATE:g}" in line
    assert compressor.learning_rate_notice(LEARNING_RATE) is None
    assert compressor.learning_rate_notice(2 * LEARNING_RATE) is None  # within RATE_FAR_ABOVE
    assert compressor.learning_rate_notice(3 * LEARNING_RATE) is not None
    assert f"use about {LEARNING_RATE:g}" in compressor.learning_rate_notice(None)


def test_signsgd_says_at_construction_that_its_shortfall_is_inherent_and_names_what_works():
    """Its miss on the CNN is the missing error feedback, not a setting (docs/quality.md): said
    once as it is built, naming efsignsgd; not by signum or EF-signSGD, which meet their targets
    there."""
    (line,) = grace.signsgd().notices(2)
    assert "no error feedback" in line and "efsignsgd sends the same bits" in line
    assert "signSGD on the CNN" in line and "on a small CNN with SGD and momentum, 3.0 points" in line
    for name in ("signum", "efsignsgd"):
        assert not [line for line in grace.build(name).notices(2) if "error feedback" in line]


def safety_cells() -> dict[str, dict[str, str]]:
    """Per compressor, per case, its cell of data/quality/safety.md (generated from the recorded
    runs, held to them by test_doc_tables.py): "PyTorch / TensorFlow", each ✓, ✗ and the gap,
    or –."""
    from scripts.quality import SAFETY_CASES
    from tests.launch import ROOT

    with open(os.path.join(ROOT, "data", "quality", "safety.md")) as f:
        rows = [line.strip().strip("|").split("|") for line in f if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert [c.strip() for c in header[1:]] == [label for _, _, label in SAFETY_CASES]
    assert all(len(cells) == len(header) for cells in body)
    return {cells[0].strip(): {f"{w}-{o}": cell.strip() for (w, o, _), cell in
                               zip(SAFETY_CASES, cells[1:])} for cells in body}


def safety_misses() -> dict[str, set[str]]:
    """Per compressor, the cases of the safety table with a miss in either framework."""
    return {name: {case for case, cell in cases.items() if "✗" in cell}
            for name, cases in safety_cells().items()}


FIGURE = re.compile(r"\+?(\d+(?:\.\d+)?)(%| points)")


def test_each_shortfall_states_the_safety_tables_figures_first():
    """A shortfall's line opens with the gap the safety table gives for each framework that
    misses, PyTorch's first (the mean over the seeds run, as the table), at the text's precision
    (+10% for a cell's +10.0%): the first figures of the text, in order. A line that quoted one
    seed, or a range, where the table gives the mean, fails."""
    cells = safety_cells()
    checked = misses = 0
    for name, cases in cells.items():
        compressor = grace.build(name).compressor
        for case, cell in cases.items():
            # each framework's miss: its gap, in % of perplexity or in points of accuracy
            wanted = [(float(m.group(1)), "%" if m.group(2) else " points") for side in
                      cell.split("/") if "✗" in side
                      for m in [re.search(r"\+(\d+(?:\.\d+)?)(%?)", side)]]
            misses += len(wanted)
            if not wanted:
                continue
            stated = FIGURE.findall(compressor.shortfalls[case])[:len(wanted)]
            assert len(stated) == len(wanted), (name, case)
            for (figure, unit), (text, text_unit) in zip(wanted, stated):
                decimals = len(text.split(".")[1]) if "." in text else 0
                assert round(figure, decimals) == float(text) and unit == text_unit, \
                    (name, case, cell, text + text_unit)
                checked += 1
    assert checked == misses >= 12


def test_the_models_named_are_the_benchmarks_cases():
    """``MODELS`` names each case of the quality benchmark by its model and its optimizer."""
    from scripts.quality import SAFETY_CASES

    assert set(MODELS) == {f"{w}-{o}" for w, o, _ in SAFETY_CASES}
    words = {"mnist": "mnist", "cnn": "CNN", "lstm": "LSTM", "words": "word model"}
    optimizers = {"sgd": "SGD", "adam": "Adam"}
    for case, text in MODELS.items():
        workload, optimizer = case.split("-")
        assert words[workload] in text and optimizers[optimizer] in text, case


def test_each_compressor_says_the_models_it_is_measured_short_on():
    """What the catalogue's safety table finds, each compressor says as it is built: exactly the
    models it misses its target on (either framework), in one line on rank 0 with what works
    there; a compressor that meets every target it was run on says nothing of the kind."""
    misses = safety_misses()
    assert set(misses) == set(grace.available())
    assert sum(len(m) for m in misses.values()) >= 5  # the table was read
    for name, missed in misses.items():
        compressor = grace.build(name).compressor
        assert set(compressor.shortfalls) == missed, name
        line = compressor.shortfall_notice()
        if not missed:
            assert line is None
            continue
        assert grace.build(name).notices(2).count(line) == 1
        assert line in grace.build(name).notices(2, optimizer_seen=False)  # the tape, a DDP hook
        for case in missed:
            assert f"on {MODELS[case]}, {compressor.shortfalls[case]}" in line
            # what works there: a setting of its own, or another compressor
            assert re.search(r"\w+\(\w+=", compressor.shortfalls[case]) or any(
                other in compressor.shortfalls[case] for other in grace.available() if other != name)


@pytest.mark.parametrize("spec", [{"compressor": "qsgd", "levels": 127},
                                  {"compressor": "randomk", "ratio": 0.1},
                                  {"compressor": "dgc", "momentum": 0.9},
                                  {"compressor": "terngrad", "memory": "residual"}])
def test_a_compression_set_otherwise_than_measured_is_not_told_it_falls_short(spec):
    """The line describes the compressor at its defaults: set otherwise (often as the line itself
    advises), it is not said; at the defaults it is."""
    default = grace.build(spec["compressor"])
    assert default.compressor.shortfall_notice() in default.notices(2)
    chosen = grace.from_params(spec)
    assert chosen.compressor.shortfall_notice() not in chosen.notices(2)
    assert chosen.compressor.shortfall_notice() not in chosen.notices(2, optimizer_seen=False)


def test_signsgd_needs_a_smaller_rate_under_the_optimizers_momentum_signum_does_not():
    """signSGD's votes pass through SGD's momentum (steady state lr / (1 - m)); signum takes it."""
    assert "use about 1e-05" in grace.signsgd().compressor.learning_rate_notice(1e-4, 0.9)
    assert grace.signum().compressor.learning_rate_notice(1e-4, 0.9) is None


def test_other_compressors_do_not_judge_the_learning_rate():
    for name in grace.available():
        if name not in ("signsgd", "signum"):
            assert grace.build(name).compressor.learning_rate_notice(10.0) is None


@pytest.mark.parametrize("name", MOMENTUM_OWNERS)
def test_each_takeover_line_says_how_to_opt_out_and_that_way_takes_nothing(name):
    """A line that says grace changed the optimizer names the setting that leaves it alone; built
    with that setting, the same call takes nothing over."""
    line = grace.build(name).take_momentum(SGD_09)
    opt_out = f"grace.{name}(keep_optimizer=True)"
    assert opt_out in line, line
    assert getattr(grace, name)(keep_optimizer=True).take_momentum(SGD_09) is None


def test_randomks_adam_line_says_how_to_leave_adam_as_it_is():
    line = grace.randomk(0.01).take_adam_moments(0.999, 1e-8)
    assert "grace.randomk(take_adam_moments=False) leaves Adam as it is" in line
    left = grace.randomk(0.01, take_adam_moments=False)
    assert left.take_adam_moments(0.999, 1e-8) is None and not left.adam_moments_taken
