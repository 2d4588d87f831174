"""``plan()``: the ``GatherConfig`` of every served row count, checked against what the
device holds co-resident; ``co_resident_limit``: that limit, the one definition.

Invariants a change must keep:

- A Lamport gather's CTAs wait on pushes from other CTAs (the peers', and on one GPU
  the other ranks'), so every CTA of every rank sharing a device must be resident
  together; a grid that does not fit waits until its spin budget runs out. So no
  plan holds more CTAs per rank than ``co_resident_limit`` allows.
- ``co_resident_limit`` is the only place that limit is derived from the device's
  count: ``HeadGather`` (through ``plan``), the emulated and the distributed timing
  targets all call it, so the tuner searches exactly the space serving accepts.
- A quarter of the device's CTA slots (``OTHER_STREAMS_SHARE``) is never planned
  for: kernels of the engine's other streams (an NCCL kernel of another group, a
  copy kernel, the next gather's early launch beyond PDL's) may hold SMs while a
  gather runs, and two ranks each missing a CTA wait on each other until the budget
  runs out. On one GPU the default plan takes 24-48 CTAs of 256 threads per rank,
  far inside the limit; only the tuner's search reaches it.
- ``plan`` is pure: the device's resident count comes in as a function, so it runs
  (and is tested) without a GPU.
"""

import dataclasses
from collections.abc import Mapping

from .config import GatherConfig, default_config
from .kernels.protocol import DEFAULT_THREADS, DEFAULT_UNROLL


OTHER_STREAMS_SHARE = 4  # 1/4 of the device's CTA slots stays free for other streams


def co_resident_limit(resident_per_device: int, sharing: int, pdl: bool) -> int:
    """CTAs per rank that stay co-resident when ``sharing`` ranks share a device that
    holds ``resident_per_device`` CTAs of the kernel, with a quarter of them left to
    the engine's other streams. With PDL a rank's next gather is launched early and
    holds SM slots beside its current one, which another rank's current kernel on the
    same device may need: halved when ranks share it."""
    early = 2 if pdl and sharing > 1 else 1
    usable = resident_per_device - resident_per_device // OTHER_STREAMS_SHARE
    return usable // (sharing * early)


def plan(rows, ctas=None, *, tp, shard, resident, sharing, pdl, threads=DEFAULT_THREADS,
         unroll=None, clamped=None) -> dict:
    """``{rows: GatherConfig}`` for every row count of ``rows``.

    ``ctas``: None (``config.default_config`` with ``threads`` and ``unroll``; unroll
    None: its choice per row count), an int for every row count, or ``{rows: int or
    GatherConfig}`` (an int takes ``threads`` and ``unroll``, DEFAULT_UNROLL if None).
    ``resident(config)``: CTAs of ``config``'s kernel the device holds
    (its ``ctas`` is ignored: occupancy depends on the compiled kernel only).
    Raises ValueError when a row count has no configuration or one that cannot be
    co-resident (``co_resident_limit`` with ``sharing`` and ``pdl``); with
    ``clamped`` (a dict) such a row is cut to the limit instead and recorded there as
    ``{rows: (asked, limit)}`` (a table tuned under another limit: an older version's,
    or a GPU whose kernel needs more registers)."""
    rows = frozenset(int(r) for r in rows)
    if not rows or min(rows) < 1:
        raise ValueError(f"rows must be a non-empty set of positive row counts, got {sorted(rows)}")
    limits = {}

    def limit(config):
        key = GatherConfig(1, **config.kernel_knobs())
        if key not in limits:
            limits[key] = co_resident_limit(resident(key), sharing, pdl)
        return limits[key]

    if ctas is None:
        ctas = {m: default_config(m, tp, shard, threads, unroll, limit) for m in rows}
    elif not isinstance(ctas, Mapping):
        ctas = dict.fromkeys(rows, ctas)
    missing = rows - set(ctas)
    if missing:
        raise ValueError(f"no CTA count for rows {sorted(missing)}")
    configs = {}
    for m in sorted(rows):
        entry = ctas[m]
        config = (entry if isinstance(entry, GatherConfig)
                  else GatherConfig(int(entry), threads,
                                    DEFAULT_UNROLL if unroll is None else unroll))
        most = limit(config)
        if config.ctas > most and clamped is not None and most >= 1:
            clamped[m] = (config.ctas, most)
            config = dataclasses.replace(config, ctas=most)
        if config.ctas > most:
            raise ValueError(
                f"{config.ctas} CTAs for {m} rows cannot all be co-resident: this device holds "
                f"{most} CTAs of {config.threads} threads per rank ({sharing} rank(s) share it"
                f"{', PDL on' if pdl else ''})")
        configs[m] = config
    return configs
