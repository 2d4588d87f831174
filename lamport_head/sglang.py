"""Deprecated import path, kept for 0.3 only (removed in 0.4): the SGLang adapter is
``lamport_head.engines.sglang`` (the ``sglang.srt.plugins`` entry point names it)."""

from .engines.sglang import (  # noqa: F401
    GATHERER, find_logits_processor, install_sglang_logits_gather, poll_before_forward, register)
