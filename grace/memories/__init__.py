"""Memories: what error feedback keeps between steps."""

from grace.memories.dgc import DGCMemory
from grace.memories.momentum import EFSignSGDMemory, MomentumMemory
from grace.memories.none import NoneMemory
from grace.memories.residual import DelayedResidualMemory, PowerSGDMemory, ResidualMemory

MEMORIES = (NoneMemory, ResidualMemory, MomentumMemory, DelayedResidualMemory, EFSignSGDMemory,
            PowerSGDMemory, DGCMemory)

__all__ = [cls.__name__ for cls in MEMORIES] + ["MEMORIES"]
