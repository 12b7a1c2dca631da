"""Communicators: how payloads travel between workers."""

from grace.communicators.allgather import Allgather
from grace.communicators.allreduce import Allreduce
from grace.communicators.alltoall import Alltoall, Auto
from grace.communicators.broadcast import Broadcast

__all__ = ["Allreduce", "Allgather", "Alltoall", "Auto", "Broadcast"]
