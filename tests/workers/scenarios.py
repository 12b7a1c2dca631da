"""Which compressors each reliability scenario runs: one table for the PyTorch and the TensorFlow
worker scripts and for the tests that read their results. A compressor that one framework does not
run in a scenario is listed in ``SKIPPED`` with the reason, so a gap between the frameworks is a
visible skip, never a silent omission."""

from __future__ import annotations

import grace

# Every compressor that keeps state between steps (residuals, velocities, warm starts, counters
# behind its draws), with parameters that give each part of that state work on common.py's model.
STATEFUL = {
    "topk": {"ratio": 0.05},
    "dgc": {"ratio": 0.05, "sample_ratio": 0.2, "warmup_steps": 2},  # and the warm-up's counter
    "powersgd": {"rank": 2},
    "randomk": {"ratio": 0.05, "seed": 3, "min_kept": 1},  # sparse on the 1,280 elements of W
    "signum": {},
    "qsgd": {},
    "efsignsgd": {},
    "onebit": {},
    "twobit": {},  # its residual (on the velocity, where the optimizer has momentum)
    "adaq": {"ratio": 0.05},
    "threshold": {"threshold": 0.2},  # about 12% pass: the encoded form, not the dense one
}

SCENARIOS = ("resume", "nonfinite")

# (framework, scenario, compressor) -> why that framework does not run it.
SKIPPED: dict = {}


def build(name: str, **overrides):
    return grace.build(name, **{**STATEFUL[name], **overrides})


def names(framework: str, scenario: str) -> list[str]:
    """The compressors ``framework``'s worker runs in ``scenario``."""
    return [n for n in STATEFUL if (framework, scenario, n) not in SKIPPED]


def params(framework: str, scenario: str):
    """``pytest.param`` per compressor, skipped with its reason where ``SKIPPED`` says so."""
    import pytest

    return [pytest.param(n, marks=pytest.mark.skip(reason=SKIPPED[(framework, scenario, n)]))
            if (framework, scenario, n) in SKIPPED else n for n in STATEFUL]
