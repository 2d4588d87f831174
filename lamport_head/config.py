"""``GatherConfig``, its default heuristic and the sweep's space. Every launch knob is a
field here and nothing else carries one; a compile-time knob is also in ``compile_gather``'s
cache key, or a kernel cached for other values comes back.
Stored Optuna studies hold ``label()``: existing fields keep their order and spelling, or
no stored study resumes. ``ctas`` is run-time, every other field compile-time."""

import dataclasses
import math
from dataclasses import dataclass

from . import dtypes
from .kernels.protocol import DEFAULT_THREADS, DEFAULT_UNROLL, STAGED_FROM, THREADS, UNROLL_MAX

SWEEP_THREADS = (128, 256, 512)  # a subset of the kernel's THREADS
SWEEP_UNROLL = (2, 4, 8)
CTA_STEPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GatherConfig:
    """``ctas`` CTAs of ``threads`` threads, each keeping ``unroll`` fragments in flight;
    validated at construction (whether they fit the device is ``plan``'s check)."""

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
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    def values(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def kernel_knobs(self) -> dict:
        """The compile-time fields: ``compile_gather``'s keywords."""
        knobs = self.values()
        del knobs["ctas"]
        return knobs


# few rows are latency-bound: more CTAs with fewer fragments each win
POLLS_PER_THREAD = 2


def peer_fragments(rows: int, tp: int, shard_width: int, dtype=dtypes.DEFAULT) -> int:
    """Fragments a rank polls in one call of ``rows``."""
    return rows * (tp - 1) * (shard_width // dtypes.fragment(dtype))


def default_ctas(rows: int, tp: int, shard_width: int, threads: int, unroll: int, limit: int,
                 dtype=dtypes.DEFAULT) -> int:
    """Enough CTAs that each thread polls about ``POLLS_PER_THREAD`` fragments (at most
    ``unroll``), within ``limit``."""
    return max(1, min(limit, math.ceil(peer_fragments(rows, tp, shard_width, dtype)
                                       / (threads * min(unroll, POLLS_PER_THREAD)))))


# rounds of the co-resident CTAs above which the default plan stages: bandwidth-bound
# rows gain the loads in flight, latency-bound rows lose the hop through shared memory
STAGE_ABOVE_ROUNDS = 6


def default_config(rows: int, tp: int, shard_width: int, threads: int, unroll, limit,
                   dtype=dtypes.DEFAULT) -> GatherConfig:
    """``default_ctas`` at ``unroll`` fragments per thread; ``unroll`` None takes DEFAULT_UNROLL
    up to ``STAGE_ABOVE_ROUNDS`` rounds and STAGED_FROM (staged) beyond, within the register
    kernel's CTA count (staging doubles the fragments in flight; more CTAs measured slower)."""
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
    return [c for c in CTA_STEPS if c <= limit]


def sweep_grid(limits, ctas=None):
    """Every configuration a sweep tries, in the walk's order (part of the study key)."""
    return [GatherConfig(c, t, u) for (t, u), limit in limits.items() for c in cta_choices(limit)
            if ctas is None or c in ctas]
