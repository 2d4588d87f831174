"""Timing harness: Lamport and stock measured the same way, in the same run.

Every candidate is verified bitwise on fresh planted data before it is timed. Then,
per path, two figures (medians over ``reps`` repetitions, a barrier and a device
sync before each; on real ranks the barrier is a ``Lockstep`` meet, where the ranks
also agree on every local failure so far):

- eager: ``calls`` back-to-back calls as serving issues them, CUDA events around
  them; the host time of issuing them is taken from the same loop (perf_counter).
- gpu: GPU time only. Distributed: a CUDA graph of two steps replayed (the kernel
  alternates the parity itself). Emulated: the stream is first held by a spin (``torch.cuda._sleep``)
  while the host queues ``steps`` whole steps behind it, so the events time the
  GPU alone. (A CUDA graph does not work there: the graph may serialize the
  virtual ranks' branches, and a rank waiting for a later branch times out.)

Targets: ``EmulatedTarget`` (TP virtual ranks on one GPU; the stock baseline is the
one-GPU equivalent, a cat of the shards), ``DistributedTarget`` (one process per
GPU under torchrun; stock is vLLM's: NCCL all-gather into ``[TP*M, V/TP]``, then the
reorder to ``[M, V]``) and ``AllToAllTarget`` (the same ranks timing the all-to-all of
vocab shards, ``lamport_head.all_to_all``, against vLLM's ``all_to_all_vocab_shards``
with the splits vLLM's batch sharding makes: ``support.splits``); ``target_for``
picks the real-rank one by the stock a route replaces.

What is timed is built by ``lamport_head.build``, as install builds it: the one
compiled kernel of a configuration (serving's give-up is a launch argument, so the
cubin timed is the cubin serving launches) and the occupancy limit the search stops at
(``build.Kernels.limit``, what install's ``plan`` accepts). Every gather here is
launched recoverable (``build.launch_flag``: 0): a failure on one rank while tuning
(an out-of-memory before its launch, say) fails that trial on every rank and never
stops a GPU context.
"""

import functools
import itertools
import math
import statistics
import time
from dataclasses import dataclass

import torch

from lamport_head import build, dtypes
from lamport_head.all_to_all import even_splits
from lamport_head.collective import PeerFailed, agree, all_max, all_min, attempt
from lamport_head.config import GatherConfig
from lamport_head.settings import SPIN_BUDGET_S
from lamport_head.table import ALL_TO_ALL_STOCK
from lamport_head.tuning.support.emulate import EmulatedAllToAll, EmulatedGather
from lamport_head.tuning.support.reference import planted, reference_all_to_all, reference_gather
from lamport_head.tuning.support.splits import vllm_splits
from lamport_head.tuning.support.stock import StockAllToAll, StockGather

ALL_GATHER, ALL_TO_ALL = "all-gather", "all-to-all"  # the collectives a target times


@dataclass(frozen=True)
class Timing:
    eager_us: float
    gpu_us: float
    host_us: float
    graph_us: float = math.nan  # GPU µs per gather when captured in a CUDA graph
    graph_host_us: float = math.nan  # host µs per gather of replaying that graph


class Lockstep:
    """The local steps of one collective method on real ranks, run so that the ranks
    never diverge (fail-stop, as NCCL's watchdog).

    ``local(fn, ...)`` runs a step that can fail on this rank alone through
    ``attempt``: it never raises; the first failure is held and the step's value is
    None. Later local steps still run: one may be cross-rank work (a gather launch,
    a graph replay) that peers' kernels wait for, and one fed a failed step's None
    just fails too. ``meet(what)`` is collective and is the ranks' barrier where it
    stands: it returns when no rank holds a failure, otherwise every rank raises
    there together (``agree``: the failing rank its own exception, the others
    ``PeerFailed``).

    Invariant for code using it: between two meets, the collectives issued do not
    depend on what happened locally, and a value from ``local`` reaches a collective
    only after a meet."""

    def __init__(self, group, device):
        self.group, self.device, self.error = group, device, None
        self.together = False  # a meet raised: every rank raised there, in step

    def local(self, fn, *args, **kwargs):
        value, error = attempt(fn, *args, **kwargs)
        if self.error is None:
            self.error = error
        return value

    def meet(self, what):
        try:
            agree(self.error, self.group, self.device, what)
        except PeerFailed:
            self.together = True
            raise
        except Exception as exc:  # this rank's own error, agreed; or the backend's
            self.together = exc is self.error
            raise


class Solo:
    """``Lockstep`` for one process (emulated ranks): no peer to keep in step, so a
    local step raises at once and a meet is nothing."""

    def local(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def meet(self, what):
        pass


SOLO = Solo()


def _begin(device):
    """Device sync, then start the clocks: the CUDA events' and the host's."""
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end, time.perf_counter()


def _finish(clocks, count, device):
    """Stop ``_begin``'s clocks: (GPU µs, host µs) per each of ``count`` operations."""
    t1 = time.perf_counter()
    start, end, t0 = clocks
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1e3 / count, (t1 - t0) * 1e6 / count


def _medians(figures):
    gpu, host = zip(*figures)
    return statistics.median(gpu), statistics.median(host)


def median_eager(fn, device, calls, reps, step):
    """Median (GPU µs, host µs) per call of ``calls`` back-to-back ``fn()``.

    ``fn`` runs ``calls`` times per repetition on every rank whatever failed locally
    (it may be a collective, or a gather its peers' kernels wait for), so it must not
    raise on one rank alone: a gather records its failures (``_trial_step``). The
    clocks are ``step``'s local steps, agreed at the meet before each repetition
    (the barrier) and after the last."""
    figures = []
    for _ in range(reps):
        step.meet("to time the eager calls")
        clocks = step.local(_begin, device)
        for _ in range(calls):
            fn()
        figures.append(step.local(_finish, clocks, calls, device))
    step.meet("to time the eager calls")
    return _medians(figures)


def _warm_up(step_pair, device):
    """``step_pair()`` once on a side stream, outside capture; then a device sync."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step_pair()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)


def _capture(step_pair):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_pair()
    return graph


def _replay(graph, times):
    for _ in range(times):
        graph.replay()


def _median_graph(step_pair, device, replays, reps, step):
    """Median (GPU µs, host µs) per step of a CUDA graph of ``step_pair`` (two steps)
    replayed ``replays`` times. Every local part (warm-up, capture, replays, clocks)
    is ``step``'s; the ranks meet after the warm-up, after the capture (so no rank
    replays a graph a peer failed to capture), before each repetition and after the
    last."""
    step.local(_warm_up, step_pair, device)
    step.meet("to warm up the gather before capture")
    graph = step.local(_capture, step_pair)
    step.meet("to capture the gather in a CUDA graph")
    step.local(_replay, graph, 1)
    step.local(torch.cuda.synchronize, device)
    figures = []
    for _ in range(reps):
        step.meet("to replay the captured gather")
        clocks = step.local(_begin, device)
        step.local(_replay, graph, replays)  # runs even after a failed _begin: peers wait
        figures.append(step.local(_finish, clocks, 2 * replays, device))
    step.meet("to replay the captured gather")
    return _medians(figures)


def gated_gpu_us(run, device, steps, reps, cycles_per_step=3_000_000):
    """GPU µs per step of ``run(steps)``, queued behind a spin; NaN if host-bound."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        gate, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        t0 = time.perf_counter()
        gate.record()
        torch.cuda._sleep(steps * cycles_per_step)  # hold the GPU while the host queues
        start.record()
        run(steps)
        end.record()
        queued = time.perf_counter() - t0
        torch.cuda.synchronize(device)
        if queued * 1e3 > gate.elapsed_time(start):  # the host set the pace: no GPU time
            return math.nan
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return statistics.median(times)


class EmulatedTarget:
    """TP virtual ranks on one GPU (see lamport_head.tuning.support.emulate)."""

    emulated = True
    objective = "gpu_us"  # eager time here is the host issuing TP launches in a row
    collective = ALL_GATHER

    def __init__(self, device, tp, vocab, *, calls=50, reps=7, replays=20,
                 budget_s=SPIN_BUDGET_S, dtype=torch.bfloat16):
        if vocab % tp or (vocab // tp) % dtypes.fragment(dtype):
            raise ValueError(f"vocab {vocab} does not split into tp={tp} shards of whole "
                             f"{dtypes.fragment(dtype)}-{dtypes.name(dtype)} fragments")
        self.device = torch.device(device)
        self.tp, self.vocab, self.shard_width = tp, vocab, vocab // tp
        self.dtype = dtypes.torch_dtype(dtype)  # the logits' dtype every trial gathers
        self.calls, self.reps, self.replays, self.budget_s = calls, reps, replays, budget_s
        self._limits = {}

    def limit(self, threads, unroll):
        """Most CTAs per rank that stay co-resident with the other virtual ranks: what
        HeadGather (AllToAll: its own kernel's) accepts for them (``build.Kernels.limit``;
        every virtual rank shares this GPU, PDL as the architecture has it, as ``build``
        builds them)."""
        key = (threads, unroll)
        if key not in self._limits:
            kernels = build.Kernels(self.device, self.tp, self.shard_width, dtype=self.dtype,
                                    all_to_all=self.collective == ALL_TO_ALL)
            self._limits[key] = kernels.limit(self.tp)(GatherConfig(1, threads, unroll))
        return self._limits[key]

    def build(self, plan, pdl=None):
        """The emulated ranks of ``plan`` (``{rows: GatherConfig}``), launched with
        ``pdl`` (None: as the architecture has it), waiting at most ``budget_s``."""
        return EmulatedGather(self.device, self.tp, self.shard_width, plan, pdl=pdl,
                              budget_s=self.budget_s, dtype=self.dtype)

    def _gather(self, rows, config):
        return self.build({rows: config})

    def _shards(self, rows):
        data = planted(self.tp, rows, self.shard_width, device=self.device, dtype=self.dtype)
        return [data[r] for r in range(self.tp)]

    def _want(self, shards):
        """Every rank's exact output of a call on ``shards``."""
        return [reference_gather(shards)] * self.tp

    def verify(self, gather, rows, calls=3):
        for _ in range(calls):
            shards = self._shards(rows)
            for out, want in zip(gather(shards), self._want(shards)):
                if not torch.equal(out.view(torch.int32), want.view(torch.int32)):
                    return False
        gather.check()
        return gather.armed()

    def lamport(self, rows, config):
        """Timing of a verified configuration; None when it fails verification or a
        wait runs out while it is measured (a failed trial, never a figure)."""
        from lamport_head.status import GatherTimeout

        try:
            return self._measure(rows, config)
        except GatherTimeout:
            return None

    def _measure(self, rows, config):
        gather = self._gather(rows, config)
        if not self.verify(gather, rows):
            return None
        shards = self._shards(rows)
        gather.host_s = 0.0
        eager, _ = median_eager(lambda: gather(shards), self.device, self.calls, self.reps,
                                 SOLO)
        host = gather.host_s / (self.calls * self.reps * self.tp)  # inside HeadGather calls
        # Each rank on its own stream, no per-step join (as real ranks run): a fork
        # and join of TP streams per step alone costs ~40 µs (benches/diagnostics/diagnose.py).
        gpu = gated_gpu_us(lambda n: gather.run_steps(shards, n), self.device, self.replays,
                            self.reps)
        graph_us, graph_host = self._captured(gather, shards)
        ok = self.verify(gather, rows, calls=1)
        return Timing(eager, gpu, host * 1e6, graph_us, graph_host) if ok else None

    def _captured(self, gather, shards):
        """Each virtual rank's graph of ``replays`` gathers on its own stream, all
        replayed concurrently: GPU µs per step (gated) and host µs per gather."""
        steps, graphs = self.replays, []
        for r, stream in enumerate(gather.streams):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(steps):
                    gather.call(r, shards[r], never_stock)
            graphs.append(graph)
        here = torch.cuda.current_stream(self.device)

        def replay(_):
            for graph, stream in zip(graphs, gather.streams):
                stream.wait_stream(here)
                with torch.cuda.stream(stream):
                    graph.replay()
            for stream in gather.streams:
                here.wait_stream(stream)

        replay(steps)  # warm-up
        torch.cuda.synchronize(self.device)
        gpu = gated_gpu_us(replay, self.device, steps, self.reps)
        t0 = time.perf_counter()
        replay(steps)
        host = (time.perf_counter() - t0) * 1e6 / (self.tp * steps)
        torch.cuda.synchronize(self.device)
        return gpu, host

    def stock(self, rows):
        shards = self._shards(rows)
        step = lambda: torch.cat(shards, dim=1)  # noqa: E731
        eager, host = median_eager(step, self.device, self.calls, self.reps, SOLO)
        gpu = gated_gpu_us(lambda n: [step() for _ in range(n)], self.device, self.replays,
                            self.reps)
        return Timing(eager, gpu, host)


TIMED_DRAW = 0  # the ``_case`` draw a row count is timed with (all-to-all: its splits)


class EmulatedAllToAllTarget(EmulatedTarget):
    """``EmulatedTarget`` of the all-to-all (``EmulatedAllToAll``): a call of M rows splits
    them ``splits(M)`` over the virtual ranks (default ``even_splits``), the same way on
    every call; limit (the all-to-all kernel's), verification (``reference_all_to_all``)
    and timings as the gather's."""

    collective = ALL_TO_ALL

    def __init__(self, device, tp, vocab, *, splits=None, **options):
        super().__init__(device, tp, vocab, **options)
        self.splits = splits or functools.partial(even_splits, tp=tp)

    def build(self, plan, pdl=None):
        return EmulatedAllToAll(self.device, self.tp, self.shard_width, plan, pdl=pdl,
                                splits={m: self.splits(m) for m in plan},
                                budget_s=self.budget_s, dtype=self.dtype)

    def _want(self, shards):
        return reference_all_to_all(shards, self.splits(shards[0].shape[0]))


class DistributedTarget:
    """One process per rank under torchrun (``lamport_head.tuning.support.procs.init_ranks``).

    Every method is collective, and every rank issues the same collectives in the same
    order whatever happens locally; every rank returns the same outcome or raises at
    the same step:

    - a step that can fail on this rank alone (planting data, the reference and the
      comparison, allocating, the timing machinery: syncs, events, streams, graph
      capture and replay) runs in a ``Lockstep``: the ranks agree at its next meet,
      and on a failure every rank raises there together (the failing rank its own
      error, the others ``PeerFailed``), the trial's gather closed first;
    - a gather call or check that fails condemns the configuration, not the run: it
      is recorded, never allowed to cut a loop short (peers' kernels wait for this
      rank's), and the trial is None on every rank (agreed by MAX);
    - a build that fails is agreed inside ``HeadGather``: None on every rank.

    Not covered: a stock collective failing inside the backend is the backend's to
    report (NCCL's watchdog, gloo's timeout). On shared-GPU ranks (gloo) the stock
    path is gloo's and has no graph figure.

    What is collective-specific (the kernels' mode and so the class built, the stock
    stand-in, a call's arguments and its expected output) is in ``collective``,
    ``_stand_in``, ``_case`` and ``_reference_of``; ``AllToAllTarget`` replaces those,
    and every step above is this class's for both."""

    emulated = False
    objective = "eager_us"  # what serving sees
    collective = ALL_GATHER  # what it times: the kernels' mode, the class built, the record's name
    _stand_in = StockGather  # the tuner's stock when no engine's is given

    def __init__(self, ranks, vocab, *, calls=50, reps=7, replays=20, budget_s=SPIN_BUDGET_S,
                 stock=None, dtype=torch.bfloat16):
        """``stock``: the engine's own gather that a route would replace (``[M, V/TP] ->
        [M, V]``, every rank calling it alike: first-use tuning passes the callable
        install found), timed and verified against in place of the tuner's NCCL
        stand-in (``StockGather``, None). It runs as the engine runs it (it may
        allocate per call), so a failure inside it is the engine's backend's to report.
        ``dtype``: the logits' dtype every trial gathers (the model's head dtype)."""
        self._engine_stock = stock
        self.dtype = dtypes.torch_dtype(dtype)
        self.ranks, self.group, self.device = ranks, ranks.group, ranks.device
        self.tp, self.rank, self.vocab, self.shard_width = ranks.world, ranks.rank, vocab, vocab // ranks.world
        self.emulated = ranks.shared  # time-sliced processes: never a serving figure
        self.calls, self.reps, self.replays, self.budget_s = calls, reps, replays, budget_s
        self._limits = {}

    def _max(self, value):
        return all_max(value, self.group, self.device)

    def _lockstep(self):
        return Lockstep(self.group, self.device)

    def limit(self, threads, unroll):
        """Most CTAs per rank every rank's GPU holds: the occupancy calculator on the
        compiled kernel of this target's collective (local, no mailbox), per rank as
        install's HeadGather (AllToAll) plans
        (``build.Kernels.limit``: every rank shares the GPU where ranks share one, PDL
        as the architecture has it), then MIN over ranks (collective). A compile that
        fails on one rank makes every rank raise, together."""
        key = (threads, unroll)
        if key not in self._limits:
            def local():
                sharing = self.tp if self.ranks.shared else 1
                kernels = build.Kernels(self.device, self.tp, self.shard_width, dtype=self.dtype,
                                        all_to_all=self.collective == ALL_TO_ALL)
                return kernels.limit(sharing)(GatherConfig(1, threads, unroll))

            # A compile that fails on one rank raises on every rank, together.
            resident, error = attempt(local)
            agree(error, self.group, self.device, "to compile the gather for its occupancy")
            self._limits[key] = all_min(resident, self.group, self.device)
        return self._limits[key]

    def _collective(self):
        """The class a trial builds, of the kernels' mode ``limit`` compiles: ``AllToAll``
        or ``HeadGather`` (read at the call, where a test replaces it)."""
        from lamport_head import all_to_all, head_gather

        return (all_to_all.AllToAll if self.collective == ALL_TO_ALL
                else head_gather.HeadGather)

    def _gather(self, rows, config, pdl=None):
        from lamport_head.mailbox_collective import Setup
        from lamport_head.status import RECOVERABLE

        return self._collective()(self.group, self.device, self.tp, self.rank, self.shard_width,
                                  {rows: config}, mode=RECOVERABLE, dtype=self.dtype,
                                  setup=Setup(pdl=pdl, budget_s=self.budget_s))

    def _stock(self, rows, step):
        """The stock collective: the engine's own (given at construction), else the
        tuner's stand-in (``_stand_in``) with its buffers built as a local step (its
        calls then allocate nothing, so once the ranks met they can fail only in the
        backend)."""
        if self._engine_stock is not None:
            return self._engine_stock
        return step.local(self._stand_in, rows, self.shard_width, self.group, self.device,
                          self.dtype)

    def _case(self, rows, draw):
        """Local: the arguments of a call of ``rows`` rows (``draw``: which of the row
        count's calls; a gather's are all alike): this rank's planted shard."""
        return _GatherCase(planted(rows, self.shard_width, device=self.device, dtype=self.dtype))

    def _output(self, case):
        """Local: the output a bare launch of ``case`` writes."""
        return torch.empty(case.rows, self.vocab, dtype=self.dtype, device=self.device)

    def _call(self, gather, case, failed):
        """One gather call; a failure is recorded in ``failed``, the caller's loop goes
        on (the trial's outcome is agreed at its end)."""
        return _trial_step(failed, case.call, gather)

    def _reference(self, gathered):
        """This rank's exact output, from the stock path's of the same call."""
        return reference_gather(gathered.split(self.shard_width, 1))

    def _reference_of(self, rows, step):
        """``want(case)``, verification's expected output of a case: the stock gather's
        output (every rank's shard reaches this rank only through a collective, which
        every rank calls), sentinel words scrubbed; the stock built as a local step."""
        stock = self._stock(rows, step)
        return lambda case: step.local(self._reference, case.stock(stock))

    def verify(self, gather, rows, failed, step, calls=3):
        """Collective: True on every rank when every rank's gather matched the reference
        bitwise in each of ``calls`` calls (draws 0 to ``calls`` - 1 of ``_case``) on
        fresh planted data, else False on every rank. A call that raises is recorded in
        ``failed`` (a failed verification); a local step that fails raises on every
        rank at ``step``'s next meet."""
        ok = True
        want = self._reference_of(rows, step)
        for draw in range(calls):
            case = step.local(self._case, rows, draw)
            step.meet("to plant the verification data")  # the stock step sends it
            expected = want(case)
            got = self._call(gather, case, failed)  # every rank calls: peers' kernels wait
            ok &= bool(step.local(_same_bits, got, expected))
        step.meet("to check the gather against the reference")
        return not self._max(0.0 if ok else 1.0)

    def lamport(self, rows, config, pdl=None):
        """Timing of a verified configuration; None (on every rank) when it fails to
        build, to verify, or a call fails or times out anywhere while measured. Any
        other local failure raises on every rank together, after the gather is closed.
        ``pdl``: as ``HeadGather`` takes it (None: the architecture's)."""
        return self._with_gather(rows, config, pdl, self._trial)

    def lm_head_overlap(self, rows, config, lm_head, pdl=None):
        """``(lm_head µs, lm_head + gather µs)`` per step, MAX over ranks: GPU time of
        a CUDA graph of two steps replayed, each step ``lm_head()`` (this rank's shard
        GEMM, a local step's result) then the gather of its output, the gather launched
        with ``pdl`` (None: the architecture's). None as ``lamport``."""
        return self._with_gather(rows, config, pdl,
                                 lambda g, m, c, step: self._overlap(g, m, c, lm_head, step))

    def _with_gather(self, rows, config, pdl, trial):
        """Build the gather (collective, all or none), ``trial(gather, rows, config,
        step)``, close it: the fail-stop skeleton every measured gather shares."""
        try:
            gather = self._gather(rows, config, pdl)  # collective and fail-stop: all or none
        except Exception:
            return None
        step = self._lockstep()
        try:
            timing = trial(gather, rows, config, step)
        except Exception:
            # Closing is collective: only where every rank raised together (at a meet).
            # Anything else came from inside a collective (the backend's to report);
            # more collectives would pair with a peer's next step.
            if step.together:
                self._close(gather)
            raise
        self._close(gather)
        return timing

    def _trial(self, gather, rows, config, step):
        failed = [False]
        if not self.verify(gather, rows, failed, step):
            return None
        case = step.local(self._case, rows, TIMED_DRAW)
        out = step.local(self._output, case)
        step.meet("to plant and allocate the trial's data")
        eager, host = median_eager(lambda: self._call(gather, case, failed), self.device,
                                    self.calls, self.reps, step)
        # the kernel keeps the parity: captured launches continue the call sequence
        graph, graph_host = _median_graph(lambda: (case.launch(gather, out, config.ctas),
                                                   case.launch(gather, out, config.ctas)),
                                          self.device, self.replays, self.reps, step)
        step.local(torch.cuda.synchronize, self.device)
        step.meet("to finish timing the gather")
        _trial_step(failed, gather.check)  # a wait that ran out on any rank: a failed trial
        bad = self._max(1.0 if failed[0] else 0.0)
        timing = Timing(self._max(eager), self._max(graph), self._max(host), self._max(graph),
                        self._max(graph_host))
        return None if bad else timing

    def _overlap(self, gather, rows, config, lm_head, step):
        failed = [False]
        if not self.verify(gather, rows, failed, step):
            return None
        out = step.local(torch.empty, rows, self.vocab, dtype=self.dtype, device=self.device)
        step.meet("to allocate the lm_head's gather output")
        alone, _ = _median_graph(lambda: (lm_head(), lm_head()), self.device, self.replays,
                                 self.reps, step)

        def pair():
            for _ in range(2):
                gather.launch(lm_head(), out, config.ctas)

        both, _ = _median_graph(pair, self.device, self.replays, self.reps, step)
        step.local(torch.cuda.synchronize, self.device)
        step.meet("to finish timing the lm_head and the gather")
        _trial_step(failed, gather.check)
        bad = self._max(1.0 if failed[0] else 0.0)
        return None if bad else (self._max(alone), self._max(both))

    def _close(self, gather):
        """Collective: release the trial's mailbox on every rank, or on none. A rank
        whose device cannot sync (a sticky CUDA error: its kernels' state is unknown)
        makes every rank keep its box rather than free one a kernel may still write."""
        synced = attempt(torch.cuda.synchronize, self.device)[1] is None
        if all_min(synced, self.group, self.device):
            _, error = attempt(gather.close)  # every rank synced: every rank reaches its barrier
            agree(error, self.group, self.device, "to close the gather")

    def stock(self, rows):
        """Reason timing, reduced (MAX) over ranks; a local failure raises on every rank."""
        step = self._lockstep()
        stock = self._stock(rows, step)
        case = step.local(self._case, rows, TIMED_DRAW)
        step.meet("to plant the stock path's data")
        call = lambda: case.stock(stock)  # noqa: E731
        eager, host = median_eager(call, self.device, self.calls, self.reps, step)
        graph = graph_host = math.nan  # gloo's host copies cannot be captured
        if not self.ranks.shared:  # captured too: DSpark's all-to-all replays in its graphs
            graph, graph_host = _median_graph(lambda: (call(), call()), self.device,
                                              self.replays, self.reps, step)
        return Timing(self._max(eager), self._max(graph), self._max(host), self._max(graph),
                      self._max(graph_host))


class AllToAllTarget(DistributedTarget):
    """``DistributedTarget`` timing the all-to-all of vocab shards (``AllToAll``, the
    kernels' all-to-all mode) on the same steps, the same fail-stop rules and the same
    figures (MAX over ranks), Lamport and stock in the same run. ``stock``: the engine's
    own all-to-all (``(shard, send_splits, num_local_rows) -> [num_local_rows, V]``,
    vLLM's ``all_to_all_vocab_shards``); None: ``StockAllToAll``.

    A call of M rows takes the splits vLLM's batch sharding makes (``vllm_splits``,
    uneven, ranks of 0 rows at small M), the same on every rank: verification draws
    0 to ``calls`` - 1, timing (both paths, the same splits) draw ``TIMED_DRAW``. Every
    rank plants every rank's shard from one seed (the same on every rank: the ranks
    draw seeds in the same order), so each checks its output bitwise against
    ``reference_all_to_all`` alone, trusting no collective."""

    collective = ALL_TO_ALL
    _stand_in = StockAllToAll

    def __init__(self, *args, splits=None, **kwargs):
        """``splits``: ``splits(M)``, one split of every M for every call (the bench's
        ``--splits``); None: ``vllm_splits``' draws."""
        super().__init__(*args, **kwargs)
        self._seeds = itertools.count()
        self.splits = splits

    def _case(self, rows, draw):
        generator = torch.Generator(device=self.device).manual_seed(next(self._seeds))
        shards = planted(self.tp, rows, self.shard_width, generator=generator, device=self.device,
                         dtype=self.dtype)
        splits = (self.splits(rows) if self.splits is not None
                  else vllm_splits(rows, self.tp, draw))
        return _AllToAllCase(list(shards), list(splits), self.rank)

    def _reference_of(self, rows, step):
        """``want(case)``: the case's own reference (no stock: every rank holds every
        shard)."""
        return lambda case: step.local(case.want)


def target_for(stock_kind):
    """The real-rank target of the collective that serves in place of ``stock_kind``
    (``table.STOCKS``), as ``install.collective`` builds it: ``AllToAllTarget`` for the
    all-to-all, ``DistributedTarget`` for a gather."""
    return AllToAllTarget if stock_kind == ALL_TO_ALL_STOCK else DistributedTarget


@dataclass(frozen=True)
class _GatherCase:
    """A gather call's arguments on one rank: its shard ``x``, ``[M, V/TP]``."""

    x: torch.Tensor

    @property
    def rows(self):
        """The rows of this rank's output."""
        return self.x.shape[0]

    def call(self, gather):
        return gather(self.x, never_stock)

    def launch(self, gather, out, ctas):
        gather.launch(self.x, out, ctas)

    def stock(self, stock):
        return stock(self.x)


@dataclass(frozen=True)
class _AllToAllCase:
    """An all-to-all call's arguments on rank ``rank``: every rank's shard (its own is
    ``x``) and the splits, the same on every rank."""

    shards: list
    splits: list
    rank: int

    @property
    def x(self):
        return self.shards[self.rank]

    @property
    def rows(self):
        """The rows of this rank's output: its split."""
        return self.splits[self.rank]

    def call(self, a2a):
        return a2a(self.x, self.splits, self.rows, never_stock)

    def launch(self, a2a, out, ctas):
        a2a.launch(self.x, out, ctas, self.splits)

    def stock(self, stock):
        return stock(self.x, self.splits, self.rows)

    def want(self):
        return reference_all_to_all(self.shards, self.splits)[self.rank]


def _trial_step(failed, fn, *args):
    """``fn(*args)``, or None with ``failed[0]`` set: a failure that condemns the
    configuration (a gather call, its check), never an error, and never a reason for
    this rank to skip what its peers do next."""
    try:
        return fn(*args)
    except Exception:
        failed[0] = True
        return None


def _same_bits(got, want):
    """Whether a gather's output (None: the call failed) equals the reference bitwise."""
    return got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))


def never_stock(*args):
    """The stock path of a row count the gather (or the all-to-all) serves: must never
    run (timing)."""
    raise AssertionError("the timed row count is served: stock must not run")
