"""``plan()``: the plan, ``{rows: GatherConfig}`` (what each served row count
launches), checked against what the device holds co-resident; ``co_resident_limit``:
that limit, the one definition. "Plan" means that mapping only (``HeadGather.configs``
holds the one served); a table's entry for a row count is a ``table.TableRow``.

Invariants a change must keep:

- A Lamport gather's CTAs wait on pushes from other CTAs (the peers', and on one GPU
  the other ranks'), so every CTA of every rank sharing a device must be resident
  together; a grid that does not fit waits until its spin budget runs out. So no
  plan holds more CTAs per rank than ``co_resident_limit`` allows.
- ``co_resident_limit`` is the only place that limit is derived from the device's
  count: ``HeadGather`` (through ``plan``), the emulated and the distributed timing
  targets all call it, so the tuner searches exactly the space serving accepts.
- The headroom is whole SMs: a quarter of the device's SMs, rounded up
  (``headroom_sms``), is never planned for. Every CTA of every rank sharing the
  device, at the kernel's CTAs per SM, fits on the other SMs. Kernels of the
  engine's other streams (a collective of another group spinning on its peers:
  NCCL, DeepEP, a custom all-reduce; a copy kernel; the next gather's early launch
  beyond PDL's) may hold SMs while a gather runs, and two ranks each missing a CTA
  wait on each other until the budget runs out. What that guarantees, and what not:
  a kernel already holding up to ``headroom_sms`` whole SMs (one that launched
  first, at any size of CTA) leaves room for the whole gather
  (``tests/test_gpu_coresidency.py`` holds exactly that many SMs with a persistent
  kernel and runs the largest plan beside it, bitwise). A kernel launched after the
  gather finds the headroom's capacity (``headroom_sms`` x the gather's CTAs per SM
  of slots), but spread over the SMs as the block scheduler placed the gather's CTAs
  (it spreads them), not as empty SMs: its CTAs fit at once if no larger than the
  gather's, else they wait for the gather to end, which it does within its budget
  (the give-up; the same test holds nearly every SM: the gather completes or gives
  up cleanly, no hang). Counting slots instead (0.3.4: a quarter of the device's CTA
  slots) gave the same numbers wherever the SM count is a multiple of 4 (every
  supported GPU: 108, 132, 148 SMs) but said nothing about SMs. On one GPU the
  default plan takes 24-48 CTAs of 256 threads per rank, far inside the limit; only
  the tuner's search reaches it.
- ``plan`` is pure: the device's resident count comes in as a function, so it runs
  (and is tested) without a GPU.
"""

import dataclasses
from collections.abc import Mapping

from .config import GatherConfig, default_config
from .dtypes import DEFAULT as DEFAULT_DTYPE
from .kernels.protocol import DEFAULT_THREADS, DEFAULT_UNROLL


OTHER_STREAMS_SHARE = 4  # 1/4 of the device's SMs (rounded up) stays free for other streams


def headroom_sms(sms: int) -> int:
    """The SMs no plan uses on a device of ``sms`` SMs: a quarter, rounded up (33 of
    the H100's and H200's 132, 37 of the B200's 148, 27 of the A100's 108)."""
    return -(-sms // OTHER_STREAMS_SHARE)


def co_resident_limit(resident_per_device: int, sharing: int, pdl: bool) -> int:
    """CTAs per rank that stay co-resident when ``sharing`` ranks share a device that
    holds ``resident_per_device`` CTAs of the kernel, with ``headroom_sms`` whole SMs
    left to the engine's other streams: the CTAs of every rank fit on the other SMs.
    ``resident_per_device`` is ``occupancy.resident_ctas``'s answer, which carries
    the device's SMs (``.sms``) and the kernel's CTAs per SM (``.per_sm``); a plain
    int (a CPU stand-in) counts one CTA per SM, so its headroom is a quarter of its
    slots, rounded up. With PDL a rank's next gather is launched early and holds SM
    slots beside its current one, which another rank's current kernel on the same
    device may need: halved when ranks share it."""
    sms = getattr(resident_per_device, "sms", None)
    per_sm = getattr(resident_per_device, "per_sm", None)
    if sms is None or per_sm is None:  # a plain count: one CTA per SM
        sms, per_sm = int(resident_per_device), 1
    early = 2 if pdl and sharing > 1 else 1
    usable = max(0, sms - headroom_sms(sms)) * per_sm
    return usable // (sharing * early)


def plan(rows, ctas=None, *, tp, shard, resident, sharing, pdl, threads=DEFAULT_THREADS,
         unroll=None, clamped=None, dtype=DEFAULT_DTYPE) -> dict:
    """The plan ``{rows: GatherConfig}`` for every row count of ``rows``.

    ``ctas``, what is asked for each row count: None (``config.default_config`` with
    ``threads`` and ``unroll``; unroll None: its choice per row count), an int (a CTA
    count) for every row count, or ``{rows: int or GatherConfig}`` (an int takes
    ``threads`` and ``unroll``, DEFAULT_UNROLL if None). ``dtype``: the logits' (a
    ``dtypes`` name or torch dtype): the default's fragments of a ``shard`` row.
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

    # asked: the CTA count or GatherConfig asked for per row count
    if ctas is None:
        asked = {m: default_config(m, tp, shard, threads, unroll, limit, dtype) for m in rows}
    elif not isinstance(ctas, Mapping):
        asked = dict.fromkeys(rows, ctas)
    else:
        asked = ctas
    missing = rows - set(asked)
    if missing:
        raise ValueError(f"no CTA count for rows {sorted(missing)}")
    configs = {}
    for m in sorted(rows):
        wanted = asked[m]
        config = (wanted if isinstance(wanted, GatherConfig)
                  else GatherConfig(int(wanted), threads,
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
