"""Checks that turn a user's mistake into a ``ValueError`` naming the parameter and what it accepts."""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable


def check_ratio(param: str, value: Any) -> float:
    """A fraction in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{param} must be a number in (0, 1], got {value!r}")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{param} must be in (0, 1], got {value!r}")
    return float(value)


def check_int(param: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{param} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{param} must be True or False, got {value!r}")
    return value


def check_choice(kind: str, value: Any, choices: Iterable[str]) -> str:
    """``value`` must be one of ``choices``; the error suggests the closest one."""
    choices = sorted(choices)
    if isinstance(value, str) and value in choices:
        return value
    message = f"unknown {kind} {value!r}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.5)
        if close:
            message += f" (did you mean {close[0]!r}?)"
    raise ValueError(f"{message}; allowed: {', '.join(choices)}")


def check_positive(param: str, value: Any) -> float:
    """A finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{param} must be a finite number > 0, got {value!r}")
    return float(value)


def check_fraction(param: str, value: Any) -> float:
    """A number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not 0.0 <= value < 1.0:
        raise ValueError(f"{param} must be in [0, 1), got {value!r}")
    return float(value)
