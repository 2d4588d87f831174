"""The environment switches the runtime reads, each defined once: the one module that
reads the environment (the tools' torchrun variables aside).

Each is one process's environment and may reach some ranks only, so install reads
them into the rank's vote and decides only on what every rank said (fail-stop: no
rank switches to stock alone). Nothing here decides; readers only.
"""

import math
import os
from pathlib import Path

from .kernels.protocol import STOP_SHIFT, trap_grace

DISABLE_ENV = "LAMPORT_HEAD_DISABLE"  # stock logits gather, whatever the tables say
FORCE_ENV = "LAMPORT_HEAD_FORCE"  # route a processor whose class has its own gather
AUTOTUNE_ENV = "LAMPORT_HEAD_AUTOTUNE"  # first-use tuning at install (default on)
# first-use tuning of the all-to-all of vocab shards where no table layer holds its key
# (default on; 0 turns it off there: a layer's section serves, a stale one measured again)
ALL_TO_ALL_ENV = "LAMPORT_HEAD_ALL_TO_ALL"
SERVE_EMULATED_ENV = "LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED"  # serve emulated sections (tests)
BUDGET_ENV = "LAMPORT_HEAD_BUDGET_S"  # seconds a serving gather waits for its peers
TABLE_ENV = "LAMPORT_HEAD_TABLE"  # a table file above the packaged and the user's
CACHE_ENV = "LAMPORT_HEAD_CACHE"  # the user table's directory
MAILBOX_ENV = "LAMPORT_HEAD_MAILBOX"  # force a mailbox backend (the same on every rank)
COMMIT_ENV = "LAMPORT_HEAD_COMMIT"  # provenance's commit where no git checkout says it
DEFAULT_ROWS = tuple(range(1, 65))  # decode batches when the engine does not say
# A serving gather's spin budget unless BUDGET_ENV says: long enough that a host stall
# of a rank (a GC pause, a slow step) is waited out, short enough that a dead peer
# stops the engine within seconds (the engine restarts; NCCL's watchdog would wait
# minutes).
SERVING_BUDGET_S = 10.0
# The other budgets, each for its own use: tools, tuning and tests (a gather built with
# no budget given); bench and the diagnostics (a stalled figure costs this, not 2 s).
SPIN_BUDGET_S = 2.0
BENCH_BUDGET_S = 0.5
MAX_BUDGET_S = 3600.0  # the timer is read every poll: a longer wait is a typo
# The floor. A gather gives up at 3/4 of the budget, so the budget must dwarf the
# ordinary skew between the ranks' launches of one step, or healthy steps give up:
# over 15x the worst skew measured (docs/figures.md, "Figures the code cites").
MIN_BUDGET_S = 0.5
# The floor of the grace between a serving give-up's flag and its trap (an eighth of the
# budget; ``kernels.protocol``): peers giving up in the same step mark this rank's
# mailbox in it, so it must cover the ranks' launch skew with room for the marking
# stores (docs/figures.md). The budget's floor gives 62.5 ms; a change of either floor
# or of STOP_SHIFT is checked here.
MIN_GRACE_S = 0.05


def trap_grace_s(budget_s: float) -> float:
    """The grace a serving gather of ``budget_s`` leaves between its flag and its trap."""
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
    """``$LAMPORT_HEAD_ALL_TO_ALL`` (default on; 0 turns it off): first-use tuning may
    measure the all-to-all of vocab shards where no table section holds its key."""
    return _flag(ALL_TO_ALL_ENV, "1")


def serve_emulated() -> bool:
    return _flag(SERVE_EMULATED_ENV, "0")


def table_override() -> Path | None:
    """``$LAMPORT_HEAD_TABLE``: the highest table layer, when set."""
    text = os.environ.get(TABLE_ENV, "")
    return Path(text) if text else None


def cache_dir() -> Path:
    """The user table's directory: ``$LAMPORT_HEAD_CACHE``, else
    ``$XDG_CACHE_HOME/lamport-head`` (XDG's default: ``~/.cache``)."""
    cache = os.environ.get(CACHE_ENV)
    if cache:
        return Path(cache)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lamport-head"


def forced_backend() -> str | None:
    """``$LAMPORT_HEAD_MAILBOX``, the mailbox backend this rank's environment forces
    (``mailbox.choose_backend`` checks that every rank asks the same)."""
    return os.environ.get(MAILBOX_ENV) or None


def commit_override() -> str | None:
    """``$LAMPORT_HEAD_COMMIT``: provenance's commit where no checkout says it."""
    return os.environ.get(COMMIT_ENV) or None


def spin_budget_s() -> float:
    """``LAMPORT_HEAD_BUDGET_S`` (default ``SERVING_BUDGET_S``); ValueError naming the
    variable for anything but a finite number of seconds in [``MIN_BUDGET_S``,
    ``MAX_BUDGET_S``] whose trap grace is at least ``MIN_GRACE_S`` (install carries
    the error in the rank's vote: every rank stock, one line each)."""
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
