"""The real-rank timing harness (``tuning.harness.DistributedTarget``) on 2-rank gloo
groups, CUDA faked: a local step that fails on one rank (planting data, allocating
the output, capturing the graph) makes every rank raise at the same step, the
trial's gather closed on every rank, and the ranks are still in step afterwards (one
more collective matches); a gather call or check that fails on one rank is a failed
trial (None) on every rank. Then the review's scenario end to end: first-use tuning
at install with the real harness, one rank's ``planted`` out of memory: every rank
stock with one warning, nobody hangs (spawn's deadline), still in step.

What is faked and why: HeadGather's CUDA-only construction (helpers.fake_cuda:
its kernels through the seam ``build.TOOLCHAIN``, the mailbox, the device key)
with a kernel stand-in that writes the gathered bytes (every rank plants the same
shard: same seed, same calls), and the CUDA timing machinery (events, side streams,
graphs) as CPU no-ops. The kernel stand-in waits for its peers' shards as the real
kernel does (``_waiting_launch``: through the group's store, bounded), so a harness
that launched a call on one rank only would wait and fail. The failures are injected at the harness's own local steps
(its ``planted``, ``torch.empty``, the graph capture), never at an agreement call."""

import contextlib
import ctypes
import dataclasses
import itertools
import os

import pytest
import torch
from spawn import spawn
from helpers import capture_log, fake_cuda, fake_timing, model

from lamport_head.tuning.support.reference import reference_gather
from lamport_head.config import GatherConfig

ROWS, SHARD = 2, 64
CONFIG = GatherConfig(4, 256, 4)


def _inject(rank, fail):
    """``fail`` = (step, n): rank 1's n-th call of that step raises (n counts from 1)."""
    step, n = fail if fail else (None, 0)
    calls = []

    def due(name):
        if rank != 1 or step != name:
            return False
        calls.append(1)
        return len(calls) == n

    return due


def _waiting_launch(rank, tp, current, wait_s=2.0):
    """A kernel stand-in that waits for its peers as the real one does: call n of
    gather g publishes this rank's shard in the group's store and waits (at most
    ``wait_s``, the spin budget) for every peer's call n of g; it writes the gathered
    row, NaN for a peer that never published, and then, like a give-up, marks this
    rank's control block (so ``check()`` raises). A harness that launched a call on
    one rank only, or in another order, waits here and fails."""
    import datetime

    import torch.distributed as dist

    from lamport_head.kernels.protocol import (CONTROL_MARK, CONTROL_MISSING, MARK_TOP,
                                               PEER_CONTROL)

    store = dist.distributed_c10d._get_default_store()

    def launch(logits, out, peers, r, ctas, budget, status, stream):
        gather = current[0]
        n = next(gather.fake_calls)
        key = f"fake-kernel/{gather.fake_gather}/{n}"
        store.set(f"{key}/{rank}", logits.contiguous().view(torch.uint8).numpy().tobytes())
        shards, missing = [], []
        for peer in range(tp):
            try:
                store.wait([f"{key}/{peer}"], datetime.timedelta(seconds=wait_s))
                raw = bytearray(store.get(f"{key}/{peer}"))
                shards.append(torch.frombuffer(raw, dtype=torch.bfloat16).view(logits.shape))
            except Exception:  # the peer never launched this call: a give-up
                missing.append(peer)
                shards.append(torch.full_like(logits, float("nan")))
        want = reference_gather(shards)
        ctypes.memmove(out, want.data_ptr(), want.numel() * want.element_size())
        if missing:
            control = ctypes.c_int64.from_address(peers + 8 * (PEER_CONTROL * tp + rank)).value
            for peer in missing:
                ctypes.c_int32.from_address(control + 4 * (CONTROL_MISSING + peer)).value = 1
            ctypes.c_int32.from_address(control + 4 * CONTROL_MARK).value = MARK_TOP - n

    return launch


def _cpu_ranks(rank, tp, fail=None):
    """This process as one of ``tp`` CPU ranks the harness can time, with the failure
    ``fail`` injected on rank 1 (see ``_inject``)."""
    from lamport_head.head_gather import HeadGather
    from lamport_head.status import GatherTimeout
    from lamport_head.tuning import harness

    torch.manual_seed(0)  # every rank plants the same shards, call for call

    current = []  # the gather whose call is launching
    launch = _waiting_launch(rank, tp, current)
    fake_cuda(setattr, rank, "ok", launch=launch)
    due = _inject(rank, fail)
    closes = []
    close = HeadGather.close
    HeadGather.close = lambda self: (closes.append(1), close(self))[1]
    init, built = HeadGather.__init__, itertools.count()

    def building(self, *args, **kwargs):
        init(self, *args, **kwargs)  # collective: every rank builds its gathers in one order
        self.fake_gather, self.fake_calls = next(built), itertools.count()

    HeadGather.__init__ = building
    call = HeadGather.__call__

    def called(self, logits, stock):
        if due("call"):
            raise RuntimeError("injected: the kernel launch failed")
        current[:] = [self]
        return call(self, logits, stock)

    HeadGather.__call__ = called
    check = HeadGather.check

    def checked(self):
        if due("check"):
            raise GatherTimeout(self.rank, (0,), 7)
        return check(self)

    HeadGather.check = checked

    planted = harness.planted

    def planting(*shape, **kwargs):
        if due("planted"):
            raise torch.OutOfMemoryError("injected: CUDA out of memory (planted)")
        return planted(*shape, **kwargs)

    harness.planted = planting
    empty = torch.empty

    def allocating(*shape, **kwargs):
        if shape == (ROWS, tp * SHARD) and kwargs.get("dtype") == torch.bfloat16 and due("empty"):
            raise torch.OutOfMemoryError("injected: CUDA out of memory (empty)")
        return empty(*shape, **kwargs)

    torch.empty = allocating

    @contextlib.contextmanager
    def graph(g, *args, **kwargs):
        if due("capture"):
            raise RuntimeError("injected: graph capture failed")
        yield

    fake_timing(graph)
    return closes


def _outcome(fn, *args):
    try:
        result = fn(*args)
        return "timing" if result is not None else "None"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _trial_worker(rank, tp, fail):
    """stock(ROWS) then lamport(ROWS, CONFIG) on the real DistributedTarget; then one
    more collective: every rank's outcomes, gathered (a rank out of step hangs it)."""
    from lamport_head.collective import all_gather_objects
    from lamport_head.tuning.support.procs import Ranks
    from lamport_head.tuning.harness import DistributedTarget

    closes = _cpu_ranks(rank, tp, fail)
    # gloo: ranks sharing one GPU, as procs.init_ranks starts them
    target = DistributedTarget(Ranks(torch.device("cpu"), rank, tp, True, "gloo"), tp * SHARD,
                               calls=4, reps=2, replays=3)
    stock = _outcome(target.stock, ROWS)
    lamport = _outcome(target.lamport, ROWS, CONFIG) if stock == "timing" else "skipped"
    return all_gather_objects({"stock": stock, "lamport": lamport, "closed": len(closes)})


def _run(tmp_path, fail):
    results = spawn(_trial_worker, 2, tmp_path, fail, deadline_s=90)
    assert results[0] == results[1]  # the gathered outcomes: both ranks still in step
    return results[0]


def test_a_trial_with_no_failure_times_on_every_rank(tmp_path):
    assert _run(tmp_path, None) == [{"stock": "timing", "lamport": "timing", "closed": 1}] * 2


PEER = "PeerFailed: lamport-head: another rank failed "


INJECTED = {"planted": "OutOfMemoryError: injected: CUDA out of memory (planted)",
            "empty": "OutOfMemoryError: injected: CUDA out of memory (empty)",
            "capture": "RuntimeError: injected: graph capture failed"}


@pytest.mark.parametrize("fail, what", [
    (("planted", 1), "to plant the stock path's data"),
    (("planted", 2), "to plant the verification data"),
    (("planted", 5), "to plant and allocate the trial's data"),
    (("empty", 1), "to plant the stock path's data"),
    (("empty", 2), "to plant the verification data"),
    (("empty", 3), "to plant and allocate the trial's data"),
    (("capture", 1), "to capture the gather in a CUDA graph"),
])
def test_a_local_step_failing_on_one_rank_raises_on_every_rank(tmp_path, fail, what):
    """Planted call 1 is stock's, 2-4 verification's, 5 the timed data's; a [M, V]
    allocation 1 is stock's output buffer (``StockGather``: its calls allocate nothing),
    2 verification's stock buffer, 3 the trial's output."""
    own = INJECTED[fail[0]]
    ranks = _run(tmp_path, fail)
    step = "stock" if fail in (("planted", 1), ("empty", 1)) else "lamport"
    assert ranks[1][step] == own
    assert ranks[0][step] == PEER + what
    # a failure inside a trial closes its gather on every rank
    assert [r["closed"] for r in ranks] == ([0, 0] if step == "stock" else [1, 1])


@pytest.mark.parametrize("fail", [("call", 2), ("call", 8), ("check", 1)])
def test_a_gather_failing_on_one_rank_is_a_failed_trial_on_every_rank(tmp_path, fail):
    """Call 2 is in verification, call 8 in the eager timing; the check follows."""
    assert _run(tmp_path, fail) == [{"stock": "timing", "lamport": "None", "closed": 1}] * 2


def _install_worker(rank, tp, cache, fail):
    """install_logits_gather with first-use tuning on the real harness (the review's
    scenario: one rank's ``planted`` runs out of memory mid-sweep), then one more
    collective, as a server's next step would issue."""
    from lamport_head import provenance
    from lamport_head.tuning import firstuse
    from lamport_head.collective import all_gather_objects

    os.environ.pop("LAMPORT_HEAD_TABLE", None)
    os.environ.update(LAMPORT_HEAD_AUTOTUNE="1", LAMPORT_HEAD_CACHE=cache)
    _cpu_ranks(rank, tp, fail)
    provenance.facts = lambda: {"driver": "580.1", "cuda": "13.0", "torch": "2.13.0",
                              "cutlass_dsl": "4.8.0", "lamport_head": "0.1.0",
                              "kernel": "abcdef123456"}
    make_target = firstuse.make_target

    def real_target(ranks, vocab, limits=firstuse.FIRST_USE_LIMITS, stock=None,
                    dtype="bfloat16", *, stock_kind="nccl-all-gather"):
        # the real DistributedTarget
        target = make_target(ranks, vocab, limits, stock, dtype, stock_kind=stock_kind)
        # The occupancy calculator needs a GPU; the limit is not under test here.
        target._limits.update({(t, u): 128 for t in limits.threads for u in (4, 8)})
        return target

    firstuse.make_target = real_target
    seen = capture_log()
    from lamport_head.engines.vllm import install_logits_gather

    m = model(lm__tp_size=tp)
    # first-use tuning times (and verifies against) the engine's own gather: a real one
    m.logits_processor._gather_logits = _engine_gather
    served = install_logits_gather(m, None, tp, rank, "cpu").rows
    after = all_gather_objects(list(served))
    return {"served": list(served), "after": after,
            "warnings": [line for line in seen if "stays stock" in line]}


def _engine_gather(x):
    """vLLM's all-gather of the last dim, as the engine's stock gather (gloo)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def test_first_use_tuning_with_one_rank_out_of_memory_leaves_every_rank_stock(tmp_path):
    """Planted call 1 is row 1's stock, 2-5 its first trial, 6 the second trial's."""
    results = spawn(_install_worker, 2, tmp_path, str(tmp_path / "cache"), ("planted", 6),
                    deadline_s=120)
    for rank, r in enumerate(results):
        assert r["served"] == [] and r["after"] == [[], []]
        (warning,) = r["warnings"]
        assert "first-use tuning failed" in warning
        assert ("OutOfMemoryError: injected" if rank == 1
                else PEER + "to plant the verification data") in warning
    assert not (tmp_path / "cache" / "head_gather.yaml").exists()


def _overlap_worker(rank, tp, fail):
    """lm_head_overlap(PDL as the architecture has it, then off) on the real
    DistributedTarget with a CPU lm_head shard; then every rank's outcomes, gathered."""
    from lamport_head.tuning.harness import DistributedTarget
    from lamport_head.benches.lmhead import LmHead

    from lamport_head.collective import all_gather_objects
    from lamport_head.tuning.support.procs import Ranks

    closes = _cpu_ranks(rank, tp, fail)
    target = DistributedTarget(Ranks(torch.device("cpu"), rank, tp, True, "gloo"), tp * SHARD,
                               calls=4, reps=2, replays=3)
    head = LmHead(ROWS, 32, SHARD, "cpu", seed=rank)
    both = target.lm_head_overlap(ROWS, CONFIG, head)
    on = _outcome(lambda: both)
    off = _outcome(target.lm_head_overlap, ROWS, CONFIG, head, False)
    return all_gather_objects({"on": on, "off": off, "closed": len(closes),
                               "pair": list(both) if both else None})


@pytest.mark.parametrize("fail, on", [(None, "timing"), (("call", 2), "None")])
def test_lm_head_overlap_agrees_on_every_rank(tmp_path, fail, on):
    """The bench's overlap figure on real ranks: (lm_head, lm_head + gather) per step
    on every rank, each gather closed; a gather call failing on one rank (call 2 is
    in verification) is a failed figure (None) on every rank, the next one measured."""
    ranks = spawn(_overlap_worker, 2, tmp_path, fail, deadline_s=90)
    assert ranks[0] == ranks[1]
    assert [{k: r[k] for k in ("on", "off", "closed")} for r in ranks[0]] == \
        [{"on": on, "off": "timing", "closed": 2}] * 2
    if on == "timing":  # the fake events say 0.5 ms per repetition of 2 x 3 steps
        assert ranks[0][0]["pair"] == [pytest.approx(500 / 6)] * 2


def _identity_worker(rank, tp, cache):
    """First-use tuning's measuring of row count ROWS on the real DistributedTarget (one
    configuration), then install's build of the tuned row. Every compile goes through a
    cache keyed by its arguments (as ``compile_gather``'s), and every launcher built is
    recorded with its phase, its kernel and its launch flag. Returns them, the tuned
    and the served configurations and the kernel identities the section was written
    with."""
    import yaml

    from lamport_head import build, install
    from lamport_head.table import user_path
    from lamport_head.tuning import firstuse

    os.environ.update(LAMPORT_HEAD_CACHE=cache)
    _cpu_ranks(rank, tp, None)
    phase, kernels, launchers = ["tune"], {}, []
    seam = build.TOOLCHAIN  # the seam's object (helpers.fake_cuda's stand-in)
    compiled, launcher = seam.compiled, seam.launcher

    def compiling(tp_, shard, config, *args, **kwargs):  # one kernel per compile key, as
        # compile_gather's: the configuration's compile-time knobs (its CTAs are run-time)
        key = repr((tp_, shard, sorted(config.kernel_knobs().items()), args,
                    sorted(kwargs.items())))
        if key not in kernels:
            kernels[key] = compiled(tp_, shard, config, *args, **kwargs)
        return kernels[key]

    def launching(kernel, device, *flag):
        key = next(k for k, v in kernels.items() if v is kernel)
        launchers.append((phase[0], key, [int(f) for f in flag]))
        return launcher(kernel, device, *flag)

    seam.compiled, seam.launcher = compiling, launching
    limits = firstuse.FirstUseLimits(ctas=(CONFIG.ctas,), threads=(CONFIG.threads,),
                                     unroll=(CONFIG.unroll,), calls=2, reps=1, replays=1)
    outcome = firstuse.measure(None, "cpu", tp, rank, 1, SHARD, [ROWS], True, "NVIDIA H200",
                               limits=limits)
    (result,) = outcome.results
    phase[0] = "serve"
    # install builds enabled entries only (Plan.of); enabled or not, the row's kernel is this
    served_entry = dataclasses.replace(result.entry, enabled=True)
    gather = install._build(None, "cpu", tp, rank, SHARD, {ROWS: served_entry}, 10.0)
    served = [[m, c.label()] for m, c in gather.plan.items()]
    gather._watcher.stop()
    gather.close()
    written = yaml.safe_load(open(user_path()).read())
    return {"launchers": launchers, "tuned": [result.rows, result.entry.config.label()],
            "served": served, "written": sorted({str(v) for v in _find(written, "kernel")})}


def _find(node, key):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key and not isinstance(v, (dict, list)):
                yield v
            else:
                yield from _find(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from _find(v, key)


def test_a_tuned_rows_kernel_is_the_kernel_install_builds_for_it(tmp_path):
    """Issue 30 item 2: first-use tuning times the very kernel install builds for the
    row (one compile key, no mode in it), launched recoverable (flag 0: a failure while
    tuning never traps), which install launches serving (flag 1); and the identity
    written with the row is that kernel's (``provenance.kernel_identity``). Before: the
    tuner compiled ``stop=False``, install ``stop=True``: two kernels."""
    from lamport_head import provenance

    results = spawn(_identity_worker, 2, tmp_path, str(tmp_path / "cache"), deadline_s=120)
    for r in results:
        assert r["tuned"] == [ROWS, CONFIG.label()] and r["served"] == [[ROWS, CONFIG.label()]]
        tuned = {key for phase, key, _ in r["launchers"] if phase == "tune"}
        served = {key for phase, key, _ in r["launchers"] if phase == "serve"}
        assert len(served) == 1 and served == tuned, (served, tuned)
        assert {tuple(f) for phase, _, f in r["launchers"] if phase == "tune"} == {(0,)}
        assert {tuple(f) for phase, _, f in r["launchers"] if phase == "serve"} == {(1,)}
        assert r["written"] == [provenance.kernel_identity()]


def _alone_worker(rank, tp, cache, at_call):
    """install_logits_gather with first-use tuning timing the engine's own gather, which
    runs out of memory on rank 1 at its ``at_call``-th call, before its collective: a
    failure of that rank alone (its peer is inside the engine's all-gather). What
    install does on each rank: returns (what it served) or raises (the worker stops)."""
    from lamport_head import provenance
    from lamport_head.engines.vllm import install_logits_gather
    from lamport_head.tuning import firstuse

    os.environ.pop("LAMPORT_HEAD_TABLE", None)
    os.environ.update(LAMPORT_HEAD_AUTOTUNE="1", LAMPORT_HEAD_CACHE=cache)
    _cpu_ranks(rank, tp)
    provenance.facts = lambda: {"driver": "580.1", "cuda": "13.0", "torch": "2.13.0",
                              "cutlass_dsl": "4.8.0", "lamport_head": "0.1.0",
                              "kernel": "abcdef123456"}
    make_target = firstuse.make_target

    def real_target(ranks, vocab, limits=firstuse.FIRST_USE_LIMITS, stock=None,
                    dtype="bfloat16", *, stock_kind="nccl-all-gather"):
        target = make_target(ranks, vocab, limits, stock, dtype, stock_kind=stock_kind)
        target._limits.update({(t, u): 128 for t in limits.threads for u in (4, 8)})
        return target

    firstuse.make_target = real_target
    calls = itertools.count(1)

    def engine_gather(x):
        if rank == 1 and next(calls) == at_call:
            raise torch.OutOfMemoryError("injected: the engine's gather ran out of memory")
        return _engine_gather(x)

    seen = capture_log()
    m = model(lm__tp_size=tp)
    m.logits_processor._gather_logits = engine_gather
    try:
        served = install_logits_gather(m, None, tp, rank, "cpu").rows
    except Exception as exc:  # what stops the worker: the engine then stops every rank
        return {"raised": f"{type(exc).__name__}: {exc}", "log": seen}
    return {"served": list(served), "log": seen}


@pytest.mark.parametrize("at_call", [1, 5])
def test_the_engines_gather_failing_on_one_rank_stops_that_worker_not_stock_alone(tmp_path,
                                                                                 at_call):
    """Issue 32 item 4 (review): first-use tuning times the engine's own gather, which
    allocates per call; one failing on one rank alone (call 1: the stock timing's
    first; 5: in the first trial's verification) leaves its peer inside the engine's
    collective. That rank must not take stock alone (its peers would diverge from it):
    install re-raises there, so the worker stops; the peer's collective then fails as
    the rank leaves, and it stops too. Nothing is written."""
    results = spawn(_alone_worker, 2, tmp_path, str(tmp_path / "cache"), at_call,
                    deadline_s=120)
    assert results[1]["raised"] == ("OutOfMemoryError: injected: the engine's gather ran out "
                                    "of memory"), results[1]
    assert any("failed on this rank alone" in line for line in results[1]["log"])
    assert "served" not in results[0], results[0]  # never stock alone, never served
    assert not (tmp_path / "cache" / "head_gather.yaml").exists()


def _all_to_all_worker(rank, tp, kind):
    """An AllToAllTarget on gloo ranks, its kernel the CPU stand-in of the
    all-to-all (tests/cpu_kernel.py: the protocol's addressing over real ipc mailboxes),
    CUDA's timing machinery faked as above: per M, the stock path's timing, the trial's
    (``lamport``: built, verified against the stock all_to_all_single + permute on
    planted data, timed eager and captured, checked, closed) and the bare launch a trial
    captures, into its output of this rank's rows (poisoned first)."""
    import cpu_kernel

    from lamport_head.benches.a2abench import splits_for
    from lamport_head.tuning.harness import AllToAllTarget, _AllToAllCase
    from lamport_head.tuning.support.procs import Ranks
    from lamport_head.tuning.support.reference import planted, reference_all_to_all

    cpu_kernel.use()
    fake_timing()
    split = splits_for(kind, tp)
    target = AllToAllTarget(Ranks(torch.device("cpu"), rank, tp, True, "gloo"), tp * SHARD,
                            calls=3, reps=2, replays=2, splits=split, budget_s=20.0)
    got = {}
    for rows in (1, 5, 8):
        timed = [_outcome(target.stock, rows), _outcome(target.lamport, rows, GatherConfig(2))]
        gather = target._gather(rows, GatherConfig(2))
        g = torch.Generator().manual_seed(rows)
        shards = [planted(rows, SHARD, generator=g) for _ in range(tp)]
        case = _AllToAllCase(shards, split(rows), rank)
        out = target._output(case)
        out.view(torch.int32).fill_(0x7FBF7FBF)  # poisoned: every word must be written
        case.launch(gather, out, 2)
        want = reference_all_to_all(shards, split(rows))[rank]
        got[rows] = timed + [list(out.shape),
                             torch.equal(out.view(torch.int32), want.view(torch.int32))]
        target._close(gather)
    return got


@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_the_all_to_all_target_verifies_times_and_launches_each_ranks_rows(tmp_path, kind):
    """Issue 43 item 5's harness: the all-to-all's target runs the gather's trial on its
    own hooks (AllToAll, its splits, the stock all-to-all, this rank's rows), every rank
    alike; a wrong hook fails its verification (None) or its launch's bytes."""
    from lamport_head.benches.a2abench import splits_for

    tp = 3
    split = splits_for(kind, tp)
    for rank, got in enumerate(spawn(_all_to_all_worker, tp, tmp_path, kind, deadline_s=120)):
        assert got == {str(m): ["timing", "timing", [split(m)[rank], tp * SHARD], True]
                       for m in (1, 5, 8)}, f"rank {rank}"
