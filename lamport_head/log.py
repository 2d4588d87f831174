"""lamport-head's log lines inside vLLM: through vLLM's own handlers.

vLLM configures only its ``vllm`` logger (handler, format, level, stream; or the
user's ``VLLM_LOGGING_CONFIG_PATH``), so records of the ``lamport_head`` logger had no
handler there and INFO lines were dropped. ``attach_to_vllm()`` forwards them to
whatever the ``vllm`` logger's handlers are when each record is emitted (a later
reconfiguration is followed), at vLLM's level, without propagating twice; a user
who configured ``lamport_head`` themselves keeps their configuration.
"""

import logging
from contextlib import contextmanager

NAME = "lamport_head"


class _ToVllm(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers, at vLLM's level."""

    def emit(self, record):
        target = logging.getLogger("vllm")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def attach_to_vllm() -> bool:
    """Route the ``lamport_head`` logger through vLLM's in this process (idempotent).
    False when vLLM's logging is not importable or ours is configured already."""
    ours = logging.getLogger(NAME)
    if any(isinstance(h, _ToVllm) for h in ours.handlers):
        return True
    if ours.handlers:
        return False
    try:
        import vllm.logger  # noqa: F401  (vLLM then configures "vllm" per process)
    except Exception:
        return False
    ours.addHandler(_ToVllm())
    ours.setLevel(logging.DEBUG)  # vLLM's level decides, in _ToVllm
    ours.propagate = False
    return True


@contextmanager
def collect():
    """The messages the ``lamport_head`` logger emits inside the block, as a list."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(NAME)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
