"""CuTe DSL device code of lamport-head: the Lamport gather and its primitives.

Imports nothing from the runtime or the tuner."""

from .compile import THREADS, CompiledGather, compile_gather
from .gather import STATUS_FLAG, STATUS_PARITY, STATUS_PEERS, STATUS_ROW, Gather
from .primitives import SENTINEL

__all__ = ["THREADS", "CompiledGather", "compile_gather", "Gather", "SENTINEL", "STATUS_FLAG", "STATUS_PARITY",
           "STATUS_PEERS", "STATUS_ROW"]
