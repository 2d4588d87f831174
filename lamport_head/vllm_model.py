"""Deprecated import path, kept for 0.3 only (removed in 0.4): finding the vLLM
LogitsProcessor to route is ``lamport_head.engines.vllm``'s."""

from .engines.vllm import FORCE_ENV, find_gather_target, forced, owns_gather  # noqa: F401
