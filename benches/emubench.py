"""``lamport-head bench`` on TP virtual ranks of one GPU (``support.emulate``).

Per row count, every GPU figure is taken with a gated queue (``harness.gated_gpu_us``:
a spin holds the GPU while the host queues every step, so the events time the GPU
alone), each virtual rank on its own stream with no join between steps, as real
ranks run (the mailbox alone orders them):

- ``gpu_us`` / ``gpu_nopdl_us``: a step of every rank's gather, PDL as the
  architecture has it / PDL off; ``default_gpu_us``: the built-in heuristic's plan;
- ``lm_head_us``: a step of every rank's lm_head shard GEMM alone (``lmhead.LmHead``);
  ``lm_head_gather_{pdl,nopdl}_us``: the GEMM then the gather of its output on each
  rank's stream, the gather launched with PDL on / off;
- ``captured_gpu_us``: every rank's CUDA graph of ``steps`` gathers, replayed together;
- ``copy_us``: a step of one plain copy per rank (``copy_``, on the rank's stream) of
  the bytes its gather writes, ``[M, V]``, with no waiting: the least a gather of one
  launch per rank could cost on this GPU at this M (launch latency included);
- ``host_us``: host µs inside one eager call made as vLLM makes it (install routes
  ``_gather_logits`` to ``functools.partial(gather, stock=...)``; serving's mode runs
  the same Python); ``add_us``: ``torch.add_`` timed the same way, same loop shape;
- ``captured_host_us``: host µs a gather adds to a graph replay: each rank's
  one-gather graph replayed after ``poll()`` (as engines do) minus a one-kernel graph.

Invariants: a gather is verified bitwise (and its mailbox found re-armed) before it
is timed and after; every wait is bounded by the spin budget ``budget_s``: a gather
that gives up is dropped (never reused: its ranks' epochs may differ), the figures
it had left to take are NaN, a note says so, and the run goes on. Every launch and
event names its stream. On one GPU the ranks' GEMMs and spinning gathers share the
SMs, so a GEMM that finds no room beside other ranks' spinning CTAs waits for their
budget: a give-up, not a hang. Each lm_head+gather run (PDL on, PDL off) therefore
has a gather of its own, measured after every other figure of its M: where it cannot
run emulated it is skipped and named (the row's ``skipped``, a note saying why), and
the other figures of that M are kept.
"""

import functools
import math
import statistics
import time

import torch

from lamport_head import build
from lamport_head.status import GatherTimeout
from lamport_head.tuning.support.reference import planted

from .floor import copy_bandwidth_gbs
from ..tuning.harness import EmulatedAllToAllTarget, EmulatedTarget, gated_gpu_us, never_stock
from .lmhead import LmHead
from .report import EMULATED

MEASURED = ("gpu_us", "gpu_nopdl_us", "default_gpu_us", "captured_gpu_us", "copy_us", "lm_head_us",
            "lm_head_gather_pdl_us", "lm_head_gather_nopdl_us", "host_us", "add_us",
            "captured_host_us")
# the lm_head GEMM then the gather of its output, per gather PDL: (figure, pdl)
OVERLAPS = (("lm_head_gather_pdl_us", None), ("lm_head_gather_nopdl_us", False))
SKIPPED = "skipped"  # the row's {figure: why} of the figures that cannot run emulated
CANNOT_EMULATE = "cannot run emulated"
OVERLAP_SKIPPED = ("the lm_head GEMM then the gather cannot run emulated here, skipped: a "
                   "virtual rank's spinning gather holds the SMs another's GEMM needs (real "
                   "ranks each have their own GPU)")


def capture(stream, body):
    """A CUDA graph of ``body()`` captured on ``stream``. Lower level than
    ``torch.cuda.graph``, whose sync, ``gc.collect()`` and cache flush per capture cost
    more than the figures here (the caller syncs once before)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            body()
        finally:
            graph.capture_end()
    return graph


def replay(graphs, streams, device, polls=None):
    """Each graph once on its stream (forked from and joined to ``device``'s current
    stream); host seconds inside the replays (and the polls before them)."""
    here = torch.cuda.current_stream(device)
    for s in streams:
        s.wait_stream(here)
    spent = 0.0
    for r, (graph, s) in enumerate(zip(graphs, streams)):
        with torch.cuda.stream(s):
            t0 = time.perf_counter()
            if polls is not None:
                polls[r]()
            graph.replay()
            spent += time.perf_counter() - t0
    for s in streams:
        here.wait_stream(s)
    return spent


def rank_steps(n, streams, device, emu=None, shards=None, heads=None):
    """``n`` steps, each rank on its own stream (forked from the caller's once, joined
    once): the rank's lm_head GEMM (``heads``) and/or its gather or all-to-all (``emu``)
    of the GEMM's output or of ``shards``."""
    here = torch.cuda.current_stream(device)
    for s in streams:
        s.wait_stream(here)
    for _ in range(n):
        for r, s in enumerate(streams):
            with torch.cuda.stream(s):
                x = heads[r]() if heads is not None else shards[r]
                if emu is not None:
                    emu.call(r, x, never_stock)
    for s in streams:
        here.wait_stream(s)


class _Broken(Exception):
    """A gather gave up while measured: drop it, its figures are NaN."""


class _CannotEmulate(Exception):
    """A run that one GPU cannot host for TP virtual ranks gave up: its figure is skipped
    (real ranks, one GPU each, can run it), the gather dropped."""


class EmulatedRunner:
    """The bench's per-row measurements on ``target``'s GPU (an ``EmulatedTarget``:
    its ``limit`` and ``verify``)."""

    mode = EMULATED

    def __init__(self, target, hidden, *, budget_s, steps=20, reps=7, calls=50):
        self.target, self.hidden, self.budget_s = target, hidden, budget_s
        target.budget_s = budget_s  # every gather the target builds waits at most this
        self.device, self.tp, self.shard_width = target.device, target.tp, target.shard_width
        self.steps, self.reps, self.calls = steps, reps, calls
        self.pdl = build.TOOLCHAIN.pdl(build.TOOLCHAIN.arch(self.device))
        self.streams = [torch.cuda.Stream(self.device) for _ in range(self.tp)]
        self.notes = []

    def bandwidth_gbs(self):
        return copy_bandwidth_gbs(self.device)

    # -- one row count -------------------------------------------------------------

    def row(self, rows, config, default):
        """``{figure: value}`` for ``MEASURED`` (NaN where not measured), and ``SKIPPED``:
        ``{figure: CANNOT_EMULATE}`` of the lm_head+gather figures skipped at this M."""
        out = dict.fromkeys(MEASURED, math.nan)
        dtype = self.target.dtype
        data = planted(self.tp, rows, self.shard_width, device=self.device, dtype=dtype)
        shards = [data[r] for r in range(self.tp)]
        heads = [LmHead(rows, self.hidden, self.shard_width, self.device, seed=r, dtype=dtype)
                 for r in range(self.tp)]
        out["lm_head_us"] = self._gated(None, lambda n: rank_steps(n, self.streams, self.device, heads=heads))
        out["copy_us"] = self.copies_us(rows)

        def main(emu, got):
            got["gpu_us"] = self._gated(emu, lambda n: rank_steps(n, emu.streams, self.device, emu, shards))
            got["host_us"], got["add_us"] = self._host(emu, shards)
            got["captured_gpu_us"], got["captured_host_us"] = self._captured(emu, shards)

        def nopdl(emu, got):
            got["gpu_nopdl_us"] = self._gated(emu, lambda n: rank_steps(n, emu.streams, self.device, emu, shards))

        def plain(emu, got):
            got["default_gpu_us"] = self._gated(emu, lambda n: rank_steps(n, emu.streams, self.device, emu, shards))

        out.update(self._measure(rows, config, None, main))
        out.update(self._measure(rows, config, False, nopdl))
        if default == config:
            out["default_gpu_us"] = out["gpu_us"]
        else:
            out.update(self._measure(rows, default, None, plain))
        # last, each on a gather of its own: one GPU may not hold a rank's GEMM beside the
        # other ranks' spinning gathers, and a give-up then costs that figure alone
        out[SKIPPED] = {}
        for figure, pdl in OVERLAPS:
            try:
                out.update(self._measure(rows, config, pdl, self._overlap(figure, heads)))
            except _CannotEmulate:
                out[SKIPPED][figure] = CANNOT_EMULATE
        return out

    def _overlap(self, figure, heads):
        """The ``_measure`` body of ``figure``: every rank's lm_head GEMM (``heads``) then
        its gather of the GEMM's output, on the rank's stream. A give-up raises
        ``_CannotEmulate``: on one GPU it is the ranks' shared SMs, not the gather."""
        def body(emu, got):
            try:
                got[figure] = self._gated(
                    emu, lambda n: rank_steps(n, emu.streams, self.device, emu, heads=heads))
            except (GatherTimeout, _Broken) as exc:
                raise _CannotEmulate(f"{OVERLAP_SKIPPED} ({exc})") from exc

        return body

    def _measure(self, rows, config, pdl, body, target=None):
        """Build, verify, ``body(emu, got)``, verify again: the figures ``got``. A
        give-up keeps those taken before it (each was checked); a failed
        verification keeps none; a body's ``_CannotEmulate`` is noted and raised.
        ``target``: whose collective and shard width (default the bench's)."""
        target = target or self.target
        got, what = {}, f"M={rows} {config.label()} pdl={'arch' if pdl is None else pdl}"
        if target is not self.target:
            what += f" {target.collective} shard {target.shard_width}"
        try:
            emu = target.build({rows: config}, pdl)
        except ValueError as exc:  # a plan this launch kind cannot hold co-resident
            self.notes.append(f"{what}: not built: {exc}")
            return got
        try:
            if not target.verify(emu, rows):
                self.notes.append(f"{what}: FAILED bitwise verification before timing")
                return {}
            body(emu, got)
            if not target.verify(emu, rows, calls=1):
                self.notes.append(f"{what}: FAILED bitwise verification after timing")
                return {}
        except (GatherTimeout, _Broken) as exc:
            self.notes.append(f"{what}: a wait gave up, this run's later figures are not "
                              f"measured ({exc})")
        except _CannotEmulate as exc:
            self.notes.append(f"{what}: {exc}")
            raise
        finally:
            self._sync()
        return got

    def _sync(self):
        if self.device.type == "cuda":  # the bench's tests run its bookkeeping on the CPU
            torch.cuda.synchronize(self.device)

    # -- bench --drafter: one gather of any shard width (benches/draftbench.py) ----------

    def target_for(self, vocab):
        """The emulated target of ``vocab`` (its shard width, limit and verification)."""
        if vocab == self.target.vocab:
            return self.target
        return EmulatedTarget(self.device, self.tp, vocab, budget_s=self.budget_s,
                              dtype=self.target.dtype)

    def all_to_all_target(self, splits):
        """The emulated all-to-all target of the bench's vocabulary, M split ``splits(M)``."""
        return EmulatedAllToAllTarget(self.device, self.tp, self.target.vocab,
                                      budget_s=self.budget_s, dtype=self.target.dtype,
                                      splits=splits)

    def gather(self, target, rows, config):
        """``{"gpu_us": ...}``: GPU µs per step of every rank's gather (``target``'s
        collective: the all-to-all's too) of ``[rows, target.shard_width]`` (gated, verified
        before and after; NaN where it failed)."""
        data = planted(self.tp, rows, target.shard_width, device=self.device, dtype=target.dtype)
        shards = [data[r] for r in range(self.tp)]

        def body(emu, got):
            got["gpu_us"] = self._gated(
                emu, lambda n: rank_steps(n, emu.streams, self.device, emu, shards))

        return {"gpu_us": math.nan, **self._measure(rows, config, None, body, target)}

    def copies_us(self, rows):
        """GPU µs per step of one ``copy_`` per rank of ``[rows, V]`` logits (what a
        rank's gather writes) on the rank's stream, gated as the gathers."""
        vocab = self.tp * self.shard_width
        pairs = [(torch.empty(rows, vocab, device=self.device, dtype=self.target.dtype),
                  torch.ones(rows, vocab, device=self.device, dtype=self.target.dtype))
                 for _ in range(self.tp)]
        return self._each_rank_us([lambda d=d, x=x: d.copy_(x) for d, x in pairs])

    def op_us(self):
        """GPU µs per step of one ``torch.add_`` of 16 floats on every rank's stream (the
        launch-latency floor of a step of one kernel per rank), gated as the gathers."""
        small = [torch.zeros(16, device=self.device) for _ in range(self.tp)]
        return self._each_rank_us([lambda x=x: x.add_(1.0) for x in small])

    # -- pieces --------------------------------------------------------------------

    def _each_rank_us(self, ops):
        """GPU µs per step of ``ops[r]()`` on rank r's stream, every rank, gated as the
        gathers (the streams forked from the caller's once and joined once)."""
        here = torch.cuda.current_stream(self.device)

        def run(n):
            for s in self.streams:
                s.wait_stream(here)
            for _ in range(n):
                for op, s in zip(ops, self.streams):
                    with torch.cuda.stream(s):
                        op()
            for s in self.streams:
                here.wait_stream(s)

        return self._gated(None, run)

    def _gated(self, emu, run):
        """GPU µs per step of ``run(n)`` (gated), after one warm-up step (cuBLAS takes
        its workspace per stream on first use). A give-up raises ``_Broken``."""
        run(1)
        torch.cuda.synchronize(self.device)
        us = gated_gpu_us(run, self.device, self.steps, self.reps)
        if emu is not None:
            self._check(emu)
        return us

    def _check(self, emu):
        try:
            emu.check()
        except GatherTimeout as exc:
            raise _Broken(str(exc)) from exc

    def _host(self, emu, shards):
        """(gather, torch.add_) median host µs per call, each call timed alone on its
        rank's stream, the same loop for both."""
        calls = [functools.partial(g, stock=never_stock) for g in emu.ranks]
        small = [torch.zeros(16, device=self.device) for _ in range(self.tp)]
        adds = [functools.partial(x.add_, 1.0) for x in small]
        args = [(x,) for x in shards]
        gather = [self._host_once(calls, args, emu.streams) for _ in range(self.reps)]
        self._check(emu)
        add = [self._host_once(adds, [()] * self.tp, emu.streams) for _ in range(self.reps)]
        return statistics.median(gather), statistics.median(add)

    def _host_once(self, fns, args, streams):
        here = torch.cuda.current_stream(self.device)
        torch.cuda.synchronize(self.device)
        for s in streams:
            s.wait_stream(here)
        spent = 0.0
        for _ in range(self.calls):
            for fn, a, s in zip(fns, args, streams):
                with torch.cuda.stream(s):
                    t0 = time.perf_counter()
                    fn(*a)
                    spent += time.perf_counter() - t0
        for s in streams:
            here.wait_stream(s)
        torch.cuda.synchronize(self.device)
        return spent * 1e6 / (self.calls * len(fns))

    def _captured(self, emu, shards):
        """(GPU µs per step of graphs of ``steps`` gathers per rank replayed together,
        host µs a gather adds to a replay beyond the graph launch)."""
        ranks, streams = emu.ranks, emu.streams

        def gathers(r, count):
            return lambda: [ranks[r](shards[r], never_stock) for _ in range(count)]

        torch.cuda.synchronize(self.device)
        many = [capture(s, gathers(r, self.steps)) for r, s in enumerate(streams)]
        replay(many, streams, self.device)  # warm-up (upload)
        torch.cuda.synchronize(self.device)
        gpu = gated_gpu_us(lambda n: replay(many, streams, self.device), self.device, self.steps,
                           self.reps)
        self._check(emu)
        small = [torch.zeros(16, device=self.device) for _ in range(self.tp)]
        torch.cuda.synchronize(self.device)
        one = [capture(s, gathers(r, 1)) for r, s in enumerate(streams)]
        base = [capture(s, functools.partial(small[r].add_, 1.0))
                for r, s in enumerate(streams)]
        polls = [g.poll for g in ranks]
        with_gather, launch_only = [], []
        for graphs, p, into in ((one, polls, with_gather), (base, None, launch_only)):
            replay(graphs, streams, self.device, p)  # warm-up (upload)
            for _ in range(self.reps):
                torch.cuda.synchronize(self.device)
                spent = sum(replay(graphs, streams, self.device, p) for _ in range(self.calls))
                into.append(spent * 1e6 / (self.calls * self.tp))
        torch.cuda.synchronize(self.device)
        self._check(emu)
        return gpu, statistics.median(with_gather) - statistics.median(launch_only)
