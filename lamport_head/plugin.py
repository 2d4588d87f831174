"""Deprecated import path, kept for 0.3 only (removed in 0.4): the vLLM plugin is
``lamport_head.engines.vllm`` (the ``vllm.general_plugins`` entry point names it)."""

from .engines.vllm import register, summary, wrap_worker  # noqa: F401
