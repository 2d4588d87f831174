"""What an install did, as a value: ``Outcome`` and ``Ranks``. Adapters decide from these
values only, never from log text (docs/design.md, "Rule for adapters").
"""

import enum
import logging
from dataclasses import dataclass, replace

from . import dtypes


class Reason(enum.Enum):
    """Why the engine's own gather stays (a closed set). Value ``(label, level)``: the
    stable name, and its log line's level (WARNING where a person should act)."""

    NO_GATHER = ("no-gather", logging.INFO)  # tp = 1: nothing to replace
    NO_PROCESSOR = ("no-processor", logging.INFO)  # no LogitsProcessor found in the model
    OWN_GATHER = ("own-gather", logging.INFO)  # its class keeps its own gather (not forced)
    FORCE_PARTIAL = ("force-partial", logging.WARNING)
    SITE = ("site", logging.INFO)
    DISABLED = ("disabled", logging.WARNING)
    RANK = ("rank", logging.WARNING)  # a rank could not take part (not CUDA, its tables, ...)
    PLANS_DIFFER = ("plans-differ", logging.WARNING)
    NO_DEVICE_KEY = ("no-device-key", logging.WARNING)  # first use cannot tell GPU sharing
    TUNING_FAILED = ("tuning-failed", logging.WARNING)  # first-use tuning failed on every rank
    EMULATED = ("emulated", logging.INFO)  # ranks share one GPU: the emulated section only
    NO_ROWS = ("no-rows", logging.INFO)
    SWITCHED_OFF = ("switched-off", logging.INFO)  # its first-use tuning turned off, no section
    BUILD_FAILED = ("build-failed", logging.WARNING)  # building the gather failed on every rank
    ENGINE = ("engine", logging.WARNING)  # the engine's release lacks a name the adapter uses
    NOT_GATHERED = ("not-gathered", logging.INFO)  # no step of this path gathers logits
    ROWS_OUTSIDE = ("rows-outside", logging.INFO)  # the shared gather serves none of its rows

    @property
    def label(self):
        return self.value[0]

    @property
    def level(self):
        return self.value[1]


@dataclass(frozen=True)
class Outcome:
    """One install's result, the same on every rank: ``rows`` served (sorted), or a
    ``Reason`` and ``message``, never both. ``shared``: served by another site's gather;
    ``dtype``: the logits dtype the gather serves (another takes the stock gather)."""

    rows: tuple = ()
    reason: object = None
    message: str = ""
    shared: bool = False
    measured: bool = False
    dtype: str = dtypes.DEFAULT

    def __post_init__(self):
        if bool(self.rows) == (self.reason is not None):
            raise ValueError(f"an Outcome either serves rows or names a reason "
                             f"(rows={self.rows!r}, reason={self.reason!r})")
        if self.reason is not None and not isinstance(self.reason, Reason):
            raise TypeError(f"reason must be a Reason, not {type(self.reason).__name__}")

    @property
    def served(self):
        return bool(self.rows)

    @classmethod
    def serving(cls, rows, shared=False, dtype=dtypes.DEFAULT):
        return cls(tuple(sorted(rows)), shared=shared, dtype=dtype)

    @classmethod
    def kept(cls, reason, message):
        return cls((), reason, message)

    def within(self, rows):
        """This outcome for a site gathering only ``rows`` (None: any)."""
        if not self.rows or rows is None:
            return self
        kept = tuple(m for m in self.rows if m in rows)
        if kept:
            return replace(self, rows=kept)
        return Outcome.kept(Reason.ROWS_OUTSIDE, f"the gather's rows {list(self.rows)} hold none "
                                                 f"of its rows 1..{max(rows)}")


@dataclass(frozen=True)
class Ranks:
    """The TP group an install runs on. ``group``: where ranks agree and exchange mailboxes
    (a CPU group where there is one); ``device_group``: where first-use tuning times stock."""

    group: object
    tp: int
    rank: int
    device: object
    dcp: int = 1
    device_group: object = None

    @property
    def timing_group(self):
        return self.device_group if self.device_group is not None else self.group
