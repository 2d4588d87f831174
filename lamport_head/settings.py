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
BUDGET_ENV = "LAMPORT_HEAD_BUDGET_S"  # seconds a serving gather waits for its peers
DEFAULT_ROWS = tuple(range(1, 65))  # decode batches when the engine does not say
# A serving gather's spin budget unless BUDGET_ENV says: long enough that a host stall
# of a rank (a GC pause, a slow step) is waited out, short enough that a dead peer
# stops the engine within seconds (the engine restarts; NCCL's watchdog would wait
# minutes). Tools and tests keep head_gather.SPIN_BUDGET_S (2 s).
SERVING_BUDGET_S = 10.0
MAX_BUDGET_S = 3600.0  # the timer is read every poll: a longer wait is a typo


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


def spin_budget_s() -> float:
    """``LAMPORT_HEAD_BUDGET_S`` (default ``SERVING_BUDGET_S``); ValueError naming the
    variable for anything but a number of seconds in (0, ``MAX_BUDGET_S``]."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return SERVING_BUDGET_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_BUDGET_S:  # NaN fails too
        raise ValueError(f"{BUDGET_ENV}={text!r}: expected seconds in (0, {MAX_BUDGET_S:g}]")
    return value
