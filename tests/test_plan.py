"""Plans (``{rows: GatherConfig}``): made by ``uniform`` or the heuristic ``default``,
checked by ``fit`` under the one co-resident limit, without a GPU;
and that limit is the same function of (resident CTAs per device, sharing, PDL) for
HeadGather and for the emulated timing target (the tuner searches what serving
accepts)."""

import types

import pytest
import torch

from lamport_head import build
from lamport_head.config import STAGE_ABOVE_ROUNDS, GatherConfig, default_config, default_ctas
from lamport_head.head_gather import HeadGather
from lamport_head.mailbox_collective import Setup
from lamport_head.status import RECOVERABLE
from lamport_head.plan import Limit, Plan, co_resident_limit, default, fit, uniform
from lamport_head.table import TableRow

TP, SHARD = 4, 64


def test_co_resident_limit_halves_for_pdl_only_when_ranks_share_the_device():
    # a plain count (a CPU stand-in) is one CTA per SM: a quarter of 1056 stays free
    assert co_resident_limit(1056, 1, True) == 792  # a GPU of its own: no halving
    assert co_resident_limit(1056, 1, False) == 792
    assert co_resident_limit(1056, 8, False) == 99
    assert co_resident_limit(1056, 8, True) == 49  # PDL's early launch holds slots too


@pytest.mark.parametrize("per_sm, sms", [(3, 132), (8, 132), (4, 148), (6, 108), (3, 130),
                                         (5, 7), (1, 1), (0, 132)])
def test_the_headroom_is_whole_sms(per_sm, sms):
    """Issue 28 item 5: the plan leaves a quarter of the device's SMs (rounded up) to
    other streams, whole: every rank's CTAs together fit on the other SMs at the
    kernel's CTAs per SM, for any sharing, and never one CTA more than that."""
    from lamport_head.occupancy import Resident
    from lamport_head.plan import headroom_sms

    resident = Resident(per_sm, sms)
    assert resident == per_sm * sms and (resident.per_sm, resident.sms) == (per_sm, sms)
    free = headroom_sms(sms)
    assert free >= sms / 4 and free - 1 < sms / 4  # a quarter, rounded up
    for sharing in (1, 2, 4, 8):
        for pdl in (False, True):
            limit = co_resident_limit(resident, sharing, pdl)
            early = 2 if pdl and sharing > 1 else 1
            assert limit * sharing * early <= (sms - free) * per_sm  # fits beside the headroom
            assert (limit + 1) * sharing * early > (sms - free) * per_sm  # and is the most
    # on the GPUs we serve the SM count is a multiple of 4: the 0.3.4 numbers (a quarter
    # of the slots) are unchanged; where it is not, whole SMs stay free, not slots
    assert co_resident_limit(Resident(3, 132), 1, False) == 297 == 396 - 396 // 4
    assert co_resident_limit(Resident(3, 130), 1, False) == 291  # 97 SMs; slots gave 293


def test_the_occupancy_count_carries_its_sms_through_the_lru_cache():
    """``occupancy.resident_ctas`` answers a ``Resident``; ``HeadGather`` and the tuning
    targets hand it to ``co_resident_limit`` unchanged (an int everywhere else)."""
    from lamport_head.occupancy import Resident

    r = Resident(4, 132)
    assert isinstance(r, int) and int(r) == 528 and r + 0 == 528 and "4 per SM" in repr(r)
    assert {r: 1}[528] == 1  # hashes as the int


def resident_by_threads(config):
    return 4096 // config.threads  # 16 of 256 threads, 32 of 128 (12 and 24 plannable)


LIMIT = Limit(resident_by_threads, 1, True)


def test_the_ways_to_make_a_plan_give_one_shape():
    heuristic = fit(default({1, 8}, LIMIT, tp=TP, shard_width=SHARD * 64), LIMIT)
    assert heuristic == {m: GatherConfig(default_ctas(m, TP, SHARD * 64, 256, 4, 12))
                         for m in (1, 8)}
    assert uniform([2, 3], 5, threads=128, unroll=2) == dict.fromkeys(
        (2, 3), GatherConfig(5, 128, 2))
    assert uniform({4}, 7) == {4: GatherConfig(7)}
    mixed = {1: GatherConfig(3), 2: GatherConfig(24, 128, 8)}
    assert fit(mixed, LIMIT) == mixed
    assert all(type(p) is Plan for p in (heuristic, uniform({4}, 7), fit(mixed, LIMIT)))


def test_a_plan_is_one_immutable_hashable_type():
    """``Plan``: what a plan is wherever it travels (the vote pickles and compares it)."""
    import pickle

    entries = {1: TableRow(GatherConfig(3), True), 2: TableRow(GatherConfig(9), False),
               4: TableRow(GatherConfig(24, 128, 8), True, filled=True)}
    plan = Plan.of(entries)  # the enabled entries' configs, filled ones included
    assert dict(plan) == {1: GatherConfig(3), 4: GatherConfig(24, 128, 8)}
    assert plan.row_counts == frozenset({1, 4}) and plan.ctas == {1: 3, 4: 24}
    assert list(plan) == [1, 4] and len(plan) == 2 and 2 not in plan
    same = Plan({4: GatherConfig(24, 128, 8), 1: GatherConfig(3)})
    assert plan == same and hash(plan) == hash(same) and {plan: 0}[same] == 0
    assert plan != Plan({1: GatherConfig(3)}) and Plan() == {} and not Plan()
    assert pickle.loads(pickle.dumps(plan)) == plan
    with pytest.raises(TypeError):
        plan[8] = GatherConfig(1)
    with pytest.raises(AttributeError):
        plan.extra = 1
    with pytest.raises(ValueError, match="rows 2 has 9"):
        Plan({2: 9})


def test_the_default_plan_stages_the_rows_that_take_many_rounds():
    """``default_config`` with unroll None: register batches of 4 while a row count's
    peer fragments take at most STAGE_ABOVE_ROUNDS rounds of the co-resident CTAs,
    staged batches of 8 beyond, within both kernels' limits (the staged kernel's own,
    and never more CTAs than the register kernel's); an unroll given is kept."""
    shard = 8 * 2560  # 2560 fragments per shard row
    per_round = 10 * 256 * 4  # 10 co-resident CTAs of 256 threads, 4 fragments each

    def limit(config):
        return {4: 10, 8: 7}[config.unroll]  # the staged kernel's own limit

    tp = 5  # 4 peers: 10240 peer fragments per row
    edge = STAGE_ABOVE_ROUNDS * per_round // (4 * 2560)  # the most rows still in registers
    assert default_config(edge, tp, shard, 256, None, limit) == GatherConfig(10, 256, 4)
    staged = default_config(edge + 1, tp, shard, 256, None, limit)
    assert staged == GatherConfig(7, 256, 8)
    assert default_config(1, tp, shard, 256, None, limit) == GatherConfig(
        default_ctas(1, tp, shard, 256, 4, 10), 256, 4)
    assert default_config(edge + 1, tp, shard, 256, 4, limit) == GatherConfig(10, 256, 4)
    limits = Limit(lambda c: {4: 14, 8: 10}[c.unroll], 1, False)  # limits 10 and 7
    planned = fit(default({1, edge + 1}, limits, tp=tp, shard_width=shard), limits)
    assert planned[1].unroll == 4 and planned[edge + 1] == GatherConfig(7, 256, 8)

    def fewer_registers(config):  # the staged kernel fits more CTAs than the register one
        return {4: 10, 8: 15}[config.unroll]

    assert default_config(edge + 1, tp, shard, 256, None, fewer_registers) == GatherConfig(
        10, 256, 8)
    assert default_config(edge + 1, tp, shard, 256, 8, fewer_registers) == GatherConfig(
        15, 256, 8)  # an unroll given: its own kernel's limit


@pytest.mark.parametrize("make, what", [
    (lambda: {}, "rows must be a non-empty set of positive row counts"),
    (lambda: {0: GatherConfig(1), 1: GatherConfig(1)}, "rows must be a non-empty set"),
    (lambda: {True: GatherConfig(1)}, "rows must be a non-empty set"),
    (lambda: {1: 4}, r"a plan maps row counts to GatherConfigs; rows 1 has 4"),
    (lambda: uniform({1}, 13), "13 CTAs for 1 rows cannot all be co-resident: this device "
                               r"holds 12 CTAs of 256 threads per rank \(1 rank\(s\) share it, "
                               r"PDL on\)"),
    (lambda: {1: GatherConfig(25, 128)}, "25 CTAs for 1 rows cannot all be co-resident"),
    (lambda: uniform({1}, 0), "ctas must be an int >= 1"),
    (lambda: uniform(set(), 1), "rows must be a non-empty set"),
])
def test_a_plan_that_cannot_be_served_is_refused(make, what):
    with pytest.raises(ValueError, match=what):
        fit(make(), LIMIT)


def test_a_row_over_the_limit_is_cut_to_it_only_when_asked():
    cut = {}
    got = fit({1: GatherConfig(13), 2: GatherConfig(30, 128, 2), 4: GatherConfig(5)}, LIMIT, cut)
    assert got == {1: GatherConfig(12), 2: GatherConfig(24, 128, 2), 4: GatherConfig(5)}
    assert cut == {1: (13, 12), 2: (30, 24)}  # the row within the limit is untouched
    with pytest.raises(ValueError, match="13 CTAs for 1 rows cannot all be co-resident"):
        fit(uniform({1}, 13), LIMIT)


def test_install_serves_a_table_row_over_the_limit_at_the_limit(monkeypatch, caplog):
    """A table tuned under another limit (0.3.0's, before a quarter of the slots was
    kept free) no longer refuses the whole gather: the row is served at the limit,
    with one line that says so."""
    import logging

    from lamport_head import install
    from lamport_head.table import TableRow

    monkeypatch.setattr(build, "TOOLCHAIN", CpuKernels(1056))  # limit 792 per rank
    monkeypatch.setattr(build, "choose_backend", lambda group, device, backend: ("ipc", 1))
    built = {}

    class Box:
        def __init__(self, group, device, tp, rank, cap, words):
            self.tp, self.words, self.cap, self.sharing = tp, words, cap, 1
            self.peers = torch.zeros(3, tp, dtype=torch.int64)

        def connect(self):
            pass

        def arm(self):
            built["armed"] = True

    monkeypatch.setattr(build, "MAILBOXES", {"ipc": Box})
    monkeypatch.setattr(build, "agree", lambda error, group, device, what: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    entries = {1: TableRow(GatherConfig(900), True), 8: TableRow(GatherConfig(64), True)}
    with caplog.at_level(logging.WARNING, logger="lamport_head"):
        gather = install._build(None, "cpu", TP, 0, SHARD, entries, 2.0)
    assert gather.plan == {1: GatherConfig(792), 8: GatherConfig(64)}
    assert gather.clamped == {1: (900, 792)}
    assert built["armed"]
    lines = [r.getMessage() for r in caplog.records if "co-resident" in r.getMessage()]
    assert lines == ["lamport-head: the table's 900 CTAs for 1 rows cannot all be co-resident "
                     "with this version's kernel on this device: served with 792 (re-tune with "
                     "`lamport-head tune`)"]
    gather._watcher.stop()


class CpuKernels(build.Toolchain):
    """The seam: kernels that 'compile' on CPU, and a device holding ``per_device``
    CTAs of any of them."""

    def __init__(self, per_device):
        self.per_device = per_device

    def arch(self, device):
        return "cpu"

    def pdl(self, arch):
        return True  # as on Hopper

    def compiled(self, tp, shard, config, pdl, arch):
        return types.SimpleNamespace(launch=lambda *args: None)

    def launcher(self, compiled, device, serving):
        return compiled.launch

    def resident(self, compiled, device):
        return self.per_device


def shared_box(tp, sharing):
    """What HeadGather reads of a LocalMailbox shared by ``sharing`` virtual ranks."""
    return types.SimpleNamespace(tp=tp, words=tp * SHARD // 2, sharing=sharing, cap=8,
                                 peers=torch.zeros(3, tp, dtype=torch.int64))


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("per_device", [1056, 2112, 264])
def test_the_emulated_targets_limit_is_what_head_gather_accepts(monkeypatch, tp, per_device):
    from lamport_head.tuning.harness import EmulatedTarget

    monkeypatch.setattr(build, "TOOLCHAIN", CpuKernels(per_device))
    limit = EmulatedTarget("cpu", tp, tp * SHARD).limit(256, 4)
    # virtual ranks share the GPU and PDL is on: halved once, not twice
    assert limit == co_resident_limit(per_device, tp, True) == (per_device * 3 // 4) // (2 * tp)
    box = shared_box(tp, tp)
    gather = HeadGather(None, "cpu", tp, 0, SHARD, {1: GatherConfig(limit)},
                        mode=RECOVERABLE, setup=Setup(mailbox=box))
    assert gather.plan == {1: GatherConfig(limit)} and gather.resident(256, 4) == limit
    with pytest.raises(ValueError, match="cannot all be co-resident"):
        HeadGather(None, "cpu", tp, 0, SHARD, {1: GatherConfig(limit + 1)},
                   mode=RECOVERABLE, setup=Setup(mailbox=box))


def test_a_gather_takes_one_plan_and_its_heuristic_by_name(monkeypatch):
    """HeadGather's ``rows`` is a plan only; the heuristic is ``HeadGather.default``,
    which plans under the same limit (``plan.fit``) as a plan given."""
    monkeypatch.setattr(build, "TOOLCHAIN", CpuKernels(1 << 16))
    configs = {1: GatherConfig(8, 128, 2), 4: GatherConfig(16)}
    g = HeadGather(None, "cpu", TP, 1, SHARD, configs, mode=RECOVERABLE,
                   setup=Setup(mailbox=shared_box(TP, TP)))
    assert g.rows == frozenset({1, 4}) and g.cap == 4 and g.plan == configs
    assert type(g.plan) is Plan and g.plan.row_counts == g.rows
    by_name = HeadGather.default(None, "cpu", TP, 1, SHARD, [1, 4], mode=RECOVERABLE,
                                 setup=Setup(mailbox=shared_box(TP, TP)))
    limit = Limit(lambda c: 1 << 16, TP, True)
    assert by_name.plan == fit(default({1, 4}, limit, tp=TP, shard_width=SHARD), limit)
    with pytest.raises(ValueError, match="a plan maps row counts to GatherConfigs"):
        HeadGather(None, "cpu", TP, 1, SHARD, {1: 8}, mode=RECOVERABLE,
                   setup=Setup(mailbox=shared_box(TP, TP)))
    with pytest.raises(ValueError, match=r"a plan maps row counts to GatherConfigs, got \[1, 4\]"):
        HeadGather(None, "cpu", TP, 1, SHARD, [1, 4], mode=RECOVERABLE,
                   setup=Setup(mailbox=shared_box(TP, TP)))
    with pytest.raises(TypeError):  # no second shape: a CTA count is plan.uniform's
        HeadGather(None, "cpu", TP, 1, SHARD, [1, 4], 8, mode=RECOVERABLE,
                   setup=Setup(mailbox=shared_box(TP, TP)))


def test_without_the_seam_a_cpu_device_is_refused():
    with pytest.raises(ValueError, match="HeadGather needs a CUDA device, got cpu"):
        HeadGather(None, "cpu", TP, 1, SHARD, uniform([1], 8), mode=RECOVERABLE,
                   setup=Setup(mailbox=shared_box(TP, TP)))
