"""A ``Plan``: row count -> ``GatherConfig``. The co-resident limit (docs/design.md, "The
spin budget and the two modes") is derived only here and checked only by ``fit``, so the
tuner searches exactly what serving accepts. Pure: the device's count comes in as a function."""

import dataclasses
from collections.abc import Mapping
from typing import Callable

from .config import GatherConfig, default_config
from . import dtypes
from .kernels.protocol import DEFAULT_THREADS, DEFAULT_UNROLL

class Plan(Mapping):
    """Row count -> ``GatherConfig``, immutable and hashable (ranks vote on it); ``ctas``
    (``{rows: CTAs}``) spares a call the attribute walk."""

    __slots__ = ("_configs", "ctas")

    def __init__(self, configs=()):
        configs = dict(configs)
        for m, config in configs.items():
            if not isinstance(config, GatherConfig):
                raise ValueError(f"a plan maps row counts to GatherConfigs; rows {m} has "
                                 f"{config!r}")
        self._configs = dict(sorted(configs.items()))
        self.ctas = {m: c.ctas for m, c in self._configs.items()}

    @classmethod
    def of(cls, entries):
        """The plan a table serves: its enabled entries' (``{rows: TableRow}``) configs."""
        return cls({m: e.config for m, e in entries.items() if e.enabled})

    @property
    def row_counts(self) -> frozenset:
        return frozenset(self._configs)

    def __getitem__(self, rows):
        return self._configs[rows]

    def __iter__(self):
        return iter(self._configs)

    def __len__(self):
        return len(self._configs)

    def __hash__(self):
        return hash(tuple(self._configs.items()))

    def __repr__(self):
        return f"Plan({self._configs!r})"

    def __reduce__(self):
        return Plan, (self._configs,)


OTHER_STREAMS_SHARE = 4  # 1/4 of the SMs, rounded up: the engine's other streams may hold them


def headroom_sms(sms: int) -> int:
    return -(-sms // OTHER_STREAMS_SHARE)


def co_resident_limit(resident_per_device: int, sharing: int, pdl: bool) -> int:
    """CTAs per rank co-resident when ``sharing`` ranks share a device holding
    ``resident_per_device`` CTAs, ``headroom_sms`` left free; halved with PDL on a shared
    device, where a rank's next gather holds slots beside its current one."""
    sms = getattr(resident_per_device, "sms", None)
    per_sm = getattr(resident_per_device, "per_sm", None)
    if sms is None or per_sm is None:
        sms, per_sm = int(resident_per_device), 1
    early = 2 if pdl and sharing > 1 else 1
    usable = max(0, sms - headroom_sms(sms)) * per_sm
    return usable // (sharing * early)


@dataclasses.dataclass
class Limit:
    """``limit(config)``: the most co-resident CTAs per rank of ``config``'s kernel, the
    device's count asked once per kernel."""

    resident: Callable[[GatherConfig], int]
    sharing: int
    pdl: bool
    _known: dict = dataclasses.field(default_factory=dict, repr=False)

    def __call__(self, config: GatherConfig) -> int:
        key = GatherConfig(1, **config.kernel_knobs())
        if key not in self._known:
            self._known[key] = co_resident_limit(self.resident(key), self.sharing, self.pdl)
        return self._known[key]


def uniform(rows, ctas: int, threads: int = DEFAULT_THREADS, unroll: int = DEFAULT_UNROLL):
    """The plan launching ``ctas`` CTAs of ``threads`` x ``unroll`` for every row count."""
    return Plan(dict.fromkeys(_row_counts(rows), GatherConfig(ctas, threads, unroll)))


def default(rows, limit: Limit, *, tp: int, shard_width: int, threads: int = DEFAULT_THREADS,
            unroll=None, dtype=dtypes.DEFAULT):
    """The heuristic's plan (``config.default_config``); ``unroll`` None: chosen per row."""
    return Plan({m: default_config(m, tp, shard_width, threads, unroll, limit, dtype)
                 for m in _row_counts(rows)})


def fit(plan, limit: Limit, clamped=None):
    """``plan`` checked against ``limit`` (ValueError); with ``clamped`` (a dict), a row over
    the limit is cut to it instead and recorded there as ``{rows: (asked, limit)}``."""
    if not isinstance(plan, Mapping):
        raise ValueError(f"a plan maps row counts to GatherConfigs, got {plan!r} (row counts "
                         "alone: plan.uniform, or the heuristic's constructor .default)")
    _row_counts(plan)
    fitted = {}
    for m, config in Plan(plan).items():  # Plan checks every value is a GatherConfig
        most = limit(config)
        if config.ctas > most and clamped is not None and most >= 1:
            clamped[m] = (config.ctas, most)
            config = dataclasses.replace(config, ctas=most)
        if config.ctas > most:
            raise ValueError(
                f"{config.ctas} CTAs for {m} rows cannot all be co-resident: this device holds "
                f"{most} CTAs of {config.threads} threads per rank ({limit.sharing} rank(s) share "
                f"it{', PDL on' if limit.pdl else ''})")
        fitted[m] = config
    return Plan(fitted)


def _row_counts(rows):
    counts = frozenset(rows)
    if not counts or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in counts):
        raise ValueError(f"rows must be a non-empty set of positive row counts, got "
                         f"{sorted(counts, key=repr)}")
    return counts
