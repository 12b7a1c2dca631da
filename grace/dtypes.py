"""Dtypes and index sizes, by name: the leaf every other module of the core may import.

Dtypes are named by strings (``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``,
``"int32"``, ``"int64"``, ``"uint8"``, ``"bool"``) so that algorithm code does not depend on any
framework's dtype objects."""

from __future__ import annotations

from typing import Any

Tensor = Any
"""A framework tensor (numpy array, torch.Tensor, tf.Tensor): opaque to algorithm code."""

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT32_MAX = 2**31 - 1
INDEX_BYTES = {"int32": 4, "int64": 8}


def index_dtype(numel: int) -> str:
    """The narrowest index dtype that addresses ``numel`` elements: int32, int64 past 2**31."""
    return "int32" if numel <= INT32_MAX else "int64"
