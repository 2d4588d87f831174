"""Deprecated import path, kept for 0.3 only (removed in 0.4): finding the vLLM
LogitsProcessor to route is ``lamport_head.engines.vllm``'s."""

from .engines.vllm import find_gather_target, owns_gather  # noqa: F401
from .settings import FORCE_ENV, forced  # noqa: F401
