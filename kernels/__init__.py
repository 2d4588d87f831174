"""CuTe DSL device code of lamport-head. Imports nothing from the runtime or the tuner;
the names in ``_LAZY`` load the DSL only when first asked for."""

import importlib

from .arch import ARCHS, has_pdl
from .protocol import SENTINEL, THREADS

_LAZY = {"CompiledGather": "compile", "compile_gather": "compile",
         "compile_all_to_all": "compile", "Gather": "gather"}

__all__ = ["ARCHS", "SENTINEL", "THREADS", "has_pdl", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lamport_head.kernels' has no attribute {name!r}")
