"""The numpy reference backend: the executable specification the framework adapters are tested
against, and a way to study an algorithm without any framework."""

from grace.backends.numpy_collectives import InProcessGroup, MPICollectives
from grace.backends.numpy_ops import NumpyOps

__all__ = ["NumpyOps", "InProcessGroup", "MPICollectives"]
