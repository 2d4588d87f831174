"""``GatherConfig``: one launch configuration of the gather, its default heuristic and
the search space the tuner walks.

Invariants a change must keep:

- Every knob of a launch is a field of ``GatherConfig`` and nothing else carries one:
  the table's ``TableRow``, the sweep's grid and study, the writer, the harness and
  ``HeadGather`` all pass a ``GatherConfig``. A new knob is a new field here (with its
  check in ``__post_init__`` and its values in the search space), the kernel's
  compile argument of the same name, and the compile key; ``label()`` and the
  study's stored values follow by construction.
- ``label()`` is what an Optuna study stores for a trial: ``'ctas=32,threads=128,
  unroll=4'``, the fields in declaration order. Existing fields keep their order and
  spelling, or every stored study stops resuming.
- ``ctas`` is a run-time argument of the kernel; every other field is a compile-time
  one (``kernel_knobs()``), so one compilation serves every CTA count.
"""

import dataclasses
import math
from dataclasses import dataclass

from . import dtypes
from .kernels.protocol import DEFAULT_THREADS, DEFAULT_UNROLL, STAGED_FROM, THREADS, UNROLL_MAX

SWEEP_THREADS = (128, 256, 512)  # the CTA sizes a sweep tries (a subset of the kernel's THREADS)
SWEEP_UNROLL = (2, 4, 8)
CTA_STEPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GatherConfig:
    """How one row count is launched: ``ctas`` CTAs of ``threads`` threads, each
    thread keeping ``unroll`` fragments in flight. Construction validates (ValueError
    naming the field); whether the CTAs fit on the device is ``plan``'s check."""

    ctas: int
    threads: int = DEFAULT_THREADS
    unroll: int = DEFAULT_UNROLL

    def __post_init__(self):
        if not _int(self.ctas) or self.ctas < 1:
            raise ValueError(f"ctas must be an int >= 1, got {self.ctas!r}")
        if not _int(self.threads) or self.threads not in THREADS:
            raise ValueError(f"threads must be one of {THREADS}, got {self.threads!r}")
        if not _int(self.unroll) or not 1 <= self.unroll <= UNROLL_MAX:
            raise ValueError(f"unroll must be an int in [1, {UNROLL_MAX}], got {self.unroll!r}")

    def label(self) -> str:
        """The values as the study stores them: every field, in declaration order."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    def values(self) -> dict:
        """{field: value}, in declaration order (the study's per-trial record)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def kernel_knobs(self) -> dict:
        """The compile-time fields (all but ``ctas``): ``compile_gather``'s keywords."""
        knobs = self.values()
        del knobs["ctas"]
        return knobs


# Fragments each thread polls under the default plan (at most its ``unroll``): few rows
# are latency-bound, so more CTAs with fewer fragments each win. Measured on one H200
# (``tuning/diagnostics/grid.py``, emulated TP 2, M = 1): 10 CTAs of 256 threads at 4
# fragments each 3.89 µs per step, 20 CTAs at 2 each 3.09 µs; many rows hit ``limit``.
POLLS_PER_THREAD = 2


def peer_fragments(rows: int, tp: int, shard_width: int, dtype=dtypes.DEFAULT) -> int:
    """Fragments a rank polls in one call of ``rows``: every peer's shard row of each
    (``shard`` values of ``dtype``, ``dtypes.fragment`` of them a fragment)."""
    return rows * (tp - 1) * (shard_width // dtypes.fragment(dtype))


def default_ctas(rows: int, tp: int, shard_width: int, threads: int, unroll: int, limit: int,
                 dtype=dtypes.DEFAULT) -> int:
    """Enough CTAs that each thread polls about ``POLLS_PER_THREAD`` fragments (at most
    ``unroll``: one batch), within ``limit``."""
    return max(1, min(limit, math.ceil(peer_fragments(rows, tp, shard_width, dtype)
                                       / (threads * min(unroll, POLLS_PER_THREAD)))))


# Rounds of a rank's co-resident CTAs (register batches of DEFAULT_UNROLL fragments) its
# peer fragments take, above which the default plan stages STAGED_FROM fragments per
# thread instead: bandwidth-bound rows gain the loads in flight, latency-bound rows
# lose the hop through shared memory. Measured on one H200 (``diagnostics/grid.py``).
STAGE_ABOVE_ROUNDS = 6


def default_config(rows: int, tp: int, shard_width: int, threads: int, unroll, limit,
                   dtype=dtypes.DEFAULT) -> GatherConfig:
    """The default plan of ``rows``: ``default_ctas`` at ``unroll`` fragments per thread,
    or, with ``unroll`` None, at DEFAULT_UNROLL while the rows take at most
    ``STAGE_ABOVE_ROUNDS`` rounds of the co-resident CTAs and at STAGED_FROM (staged)
    beyond, within the register kernel's CTA count: staging doubles the fragments in
    flight at that count, and more CTAs than that were measured slower (one H200,
    emulated TP 2: 148 staged CTAs against 74-99). ``limit(config)``: the co-resident
    CTAs of ``config``'s kernel; ``dtype``: the logits' (the shard's bytes)."""
    most = limit(GatherConfig(1, threads, DEFAULT_UNROLL if unroll is None else unroll))
    if most < 1:
        raise ValueError(f"no CTA of {threads} threads can be co-resident on this device beside "
                         "the ranks sharing it")
    if unroll is None:
        rounds = peer_fragments(rows, tp, shard_width, dtype) / (most * threads * DEFAULT_UNROLL)
        unroll = STAGED_FROM if rounds > STAGE_ABOVE_ROUNDS else DEFAULT_UNROLL
        most = min(most, limit(GatherConfig(1, threads, unroll)))
    return GatherConfig(default_ctas(rows, tp, shard_width, threads, unroll, most, dtype), threads,
                        unroll)


def cta_choices(limit):
    """The CTA counts a sweep tries under a co-resident ``limit``."""
    return [c for c in CTA_STEPS if c <= limit]


def sweep_grid(limits, ctas=None):
    """Every configuration a sweep tries: for each ``(threads, unroll)`` of ``limits``
    (in its order), each CTA step up to its limit, narrowed to ``ctas`` when given.
    The order is the walk's order and part of the study key: keep it."""
    return [GatherConfig(c, t, u) for (t, u), limit in limits.items() for c in cta_choices(limit)
            if ctas is None or c in ctas]
