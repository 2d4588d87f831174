"""The environment switches the runtime reads, each defined once.

Each is one process's environment and may reach some ranks only, so install reads
them into the rank's vote and decides only on what every rank said (fail-stop: no
rank switches to stock alone). Nothing here decides; readers only.
"""

import os

DISABLE_ENV = "LAMPORT_HEAD_DISABLE"  # stock logits gather, whatever the tables say
FORCE_ENV = "LAMPORT_HEAD_FORCE"  # route a processor whose class has its own gather
AUTOTUNE_ENV = "LAMPORT_HEAD_AUTOTUNE"  # first-use tuning at install (default on)
SERVE_EMULATED_ENV = "LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED"  # serve emulated sections (tests)
DEFAULT_ROWS = tuple(range(1, 65))  # decode batches when the engine does not say


def _set(name):
    return os.environ.get(name, "") not in ("", "0")


def _flag(name, default):
    return os.environ.get(name, default).strip().lower() not in ("", "0", "false", "no", "off")


def disabled() -> bool:
    return _set(DISABLE_ENV)


def forced() -> bool:
    return _set(FORCE_ENV)


def autotune_enabled() -> bool:
    return _flag(AUTOTUNE_ENV, "1")


def serve_emulated() -> bool:
    return _flag(SERVE_EMULATED_ENV, "0")
