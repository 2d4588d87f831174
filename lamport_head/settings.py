"""The environment switches the runtime reads, each defined once (what each does:
docs/engines.md); the only module that reads the environment. Readers only: what they say
may reach some ranks only, so install carries it in the rank's vote.
"""

import math
import os
from pathlib import Path

from .kernels.protocol import STOP_SHIFT, trap_grace

DISABLE_ENV = "LAMPORT_HEAD_DISABLE"
FORCE_ENV = "LAMPORT_HEAD_FORCE"
AUTOTUNE_ENV = "LAMPORT_HEAD_AUTOTUNE"
ALL_TO_ALL_ENV = "LAMPORT_HEAD_ALL_TO_ALL"
SERVE_EMULATED_ENV = "LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED"
BUDGET_ENV = "LAMPORT_HEAD_BUDGET_S"
TABLE_ENV = "LAMPORT_HEAD_TABLE"
CACHE_ENV = "LAMPORT_HEAD_CACHE"
MAILBOX_ENV = "LAMPORT_HEAD_MAILBOX"
COMMIT_ENV = "LAMPORT_HEAD_COMMIT"
DEFAULT_ROWS = tuple(range(1, 65))  # decode batches when the engine does not say
# long enough to wait out a rank's host stall (a GC pause), short enough that a dead peer
# stops the engine within seconds (NCCL's watchdog would wait minutes)
SERVING_BUDGET_S = 10.0
# tools, tuning and tests (a gather built with no budget given); bench and the diagnostics
SPIN_BUDGET_S = 2.0
BENCH_BUDGET_S = 0.5
MAX_BUDGET_S = 3600.0  # the timer is read every poll: a longer wait is a typo
# a gather gives up at 3/4 of the budget, which must dwarf the ranks' ordinary launch skew
# (docs/figures.md, "Figures the code cites")
MIN_BUDGET_S = 0.5
# the grace between a serving give-up's flag and its trap: peers giving up in the same
# step mark this rank in it, so it must cover the launch skew and their marking stores
MIN_GRACE_S = 0.05


def trap_grace_s(budget_s: float) -> float:
    return trap_grace(budget_s)


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


def all_to_all_enabled() -> bool:
    return _flag(ALL_TO_ALL_ENV, "1")


def serve_emulated() -> bool:
    return _flag(SERVE_EMULATED_ENV, "0")


def table_override() -> Path | None:
    text = os.environ.get(TABLE_ENV, "")
    return Path(text) if text else None


def cache_dir() -> Path:
    cache = os.environ.get(CACHE_ENV)
    if cache:
        return Path(cache)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lamport-head"


def forced_backend() -> str | None:
    """``mailbox.choose_backend`` checks that every rank asks the same."""
    return os.environ.get(MAILBOX_ENV) or None


def commit_override() -> str | None:
    return os.environ.get(COMMIT_ENV) or None


def spin_budget_s() -> float:
    """``BUDGET_ENV`` (default ``SERVING_BUDGET_S``); ValueError naming it outside the floors
    and ``MAX_BUDGET_S`` (install carries the error in the rank's vote)."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    if not text:
        return SERVING_BUDGET_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and 0 < value <= MAX_BUDGET_S):
        raise ValueError(f"{BUDGET_ENV}={text!r}: expected seconds in (0, {MAX_BUDGET_S:g}]")
    if value < MIN_BUDGET_S:
        raise ValueError(f"{BUDGET_ENV}={text!r}: below the floor of {MIN_BUDGET_S:g} s (a "
                         f"gather gives up at 3/4 of it: a shorter budget gives up on the "
                         f"ordinary skew between ranks)")
    if trap_grace_s(value) < MIN_GRACE_S:
        raise ValueError(f"{BUDGET_ENV}={text!r}: its trap grace ({trap_grace_s(value):g} s, "
                         f"1/{1 << STOP_SHIFT} of it) is below the floor of {MIN_GRACE_S:g} s "
                         f"(peers giving up in the same step must mark this rank before it "
                         f"traps)")
    return value
