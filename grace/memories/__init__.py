"""Memories: what error feedback keeps between steps."""

from grace.memories.none import NoneMemory
from grace.memories.residual import ResidualMemory

__all__ = ["NoneMemory", "ResidualMemory"]
