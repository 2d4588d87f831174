"""HeadGather: the vocab-parallel lm_head's gather ``[M, V/TP] -> [M, V]`` (BF16) for a
set of row counts, on two parities of a Lamport mailbox.

Invariants a change must keep:

- Parity alternates per launch, kept by the kernel itself (the rank's epoch in
  device memory), and every rank launches in the same order (the model runner's):
  two uses of a parity are then separated by a use of the other, so a rank pushes
  into a parity only after every peer finished reading and re-arming it. Under CUDA
  graph capture the launch is recorded like any other: each replay reads and
  advances the epoch, so replays and eager calls interleave on one stream. An eager
  call on another stream than the previous call first waits for the previous
  stream, so the calls stay one sequence (graph replays must be issued in that
  order by the caller, as engines do).
- Every shape the kernel does not serve takes ``stock``: rows not in ``rows``, not
  2-D, not BF16, the wrong width. The decision depends on the shape only, so every
  rank takes the same path (and a captured graph holds the same path on every rank);
  a non-contiguous or unaligned tensor (the allocator's choice, which may differ by
  rank) is copied, and a tensor on another device raises.
- Bytes move unchanged but for the sentinel word (+0, -0), which arrives as (+0, +0).
- Fail-stop, serving mode (``mode="serving"``, what install builds for engines): a
  wait past three quarters of the spin budget marks every rank's mailbox, and the
  launch that gave up (or began marked) stops this process's GPU context (``trap``)
  once all its CTAs are done, after writing the status record (timing:
  ``kernels.protocol``). No later kernel of the stream runs, so no value of that step
  reaches a sampler or the host: the engine's next CUDA call raises, every peer stops
  the same way, and the watcher logs the missing ranks (the engine's own error cannot
  name them). The watcher is also the watchdog (``status.Watcher``): a context that
  did not stop when its trap was due, or a launch whose slow heartbeat stays up with
  no record, ends the process. Nothing here recovers; the engine restarts.
- Fail-stop, recoverable mode (the default; tools, tuning, tests): a wait past the
  spin budget in call s writes the missing fragments as NaN and marks every rank's
  mailbox; every rank's call s + 1 then fails too and
  raises the host flag, so a loop that syncs once per step raises ``GatherTimeout``
  at call s + 2 on every rank alike (``check()`` after a sync raises as soon as the
  mark is there), and keeps raising until a collective ``reset()``. No rank ever
  switches to ``stock`` on its own. A host that runs ahead of its GPU (async
  scheduling) reads the flag without a sync, so it raises within its in-flight depth
  of calls after s + 2, possibly later than a peer; that peer's raise stops the
  engine (vLLM and SGLang treat a worker's exception as fatal) and the NCCL watchdog
  bounds any rank left waiting in a collective meanwhile. Calls s and s + 1 return
  tensors holding NaN where a rank's fragments are missing: a caller that must never
  hand on such a step syncs and calls ``check()`` before using it. A graph replay
  runs no ``__call__``: its caller ``poll()``s first.
- Construction is collective on real ranks, and never strands a peer: the local
  part (checks, compile, occupancy, allocation) runs first, the ranks agree, then the
  mailboxes are mapped, the ranks agree again, arm, and meet at a barrier. Every step
  (the backend's facts, compile, allocation, mapping, arm + sync) runs under the
  start-up deadline (``mailbox.RENDEZVOUS_WAIT_S``) with its collectives kept on the
  constructing thread (``collective.step``): a rank blocking in one fails it at the
  deadline and every rank raises, within it.
- What each row count launches is ``plan.plan``'s answer, checked against
  ``plan.co_resident_limit`` (every CTA of every rank sharing the device resident at
  once); the compiler and the driver are reached only through ``KERNELS``.
"""

from collections.abc import Mapping

import torch

from .collective import agree, attempt, step
from .config import GatherConfig
from .kernels.arch import has_pdl
from .kernels.protocol import (CONTROL_MARK, CONTROL_MISSING, DEFAULT_THREADS, DEFAULT_UNROLL,
                               FRAGMENT_BF16, MARK_TOP, slow_after, trap_grace)
from .mailbox import MAILBOXES, choose_backend
from .plan import co_resident_limit, plan
from .settings import SPIN_BUDGET_S
from .status import (MODES, RECOVERABLE, SERVING, STOP_GRACE_S, GatherTimeout, StatusRecord,
                     Watcher)

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class DeviceKernels:
    """Where a gather's kernels come from: the device's compile target, the compiled
    gather of a ``GatherConfig``, and how many CTAs of it the device holds. The only
    place construction touches the compiler and the driver; ``KERNELS`` is the seam a
    test replaces (with a CPU stand-in) to build gathers without a GPU."""

    def arch(self, device) -> str:
        """The compile target of ``device``; ValueError for a device the kernel cannot
        run on."""
        if device.type != "cuda":
            raise ValueError(f"HeadGather needs a CUDA device, got {device}")
        from .occupancy import device_arch

        return device_arch(device)

    def pdl(self, arch) -> bool:
        """Whether gathers for ``arch`` launch with PDL (the architecture decides:
        ``kernels.arch.has_pdl``)."""
        return has_pdl(arch)

    def compiled(self, tp, shard, config, pdl, arch, stop=False):
        """The compiled gather (``.launch``, ``.cubin``, ``.threads``) for ``config``'s
        compile-time knobs (compiled once per process); ``stop``: serving's give-up."""
        from .kernels import compile_gather

        return compile_gather(tp, shard // 2, pdl=pdl, arch=arch, stop=stop,
                              **config.kernel_knobs())

    def launcher(self, compiled, device):
        """How a gather launches ``compiled`` on ``device``: through the driver
        (``kernels.launch.DriverLaunch``: the TVM-FFI callable costs the host 1.4x a
        ``torch.add_`` per call, this launch 0.9x), loaded into the device's primary
        context (torch's). Called as ``launcher(shard, out, peers, rank, ctas, budget,
        status, stream)``."""
        from .kernels import DriverLaunch
        from .kernels.launch import bind_primary_context

        with torch.cuda.device(device):
            bind_primary_context(torch.device(device).index)
            return DriverLaunch(compiled)

    def resident(self, compiled, device) -> int:
        """CTAs of ``compiled`` the whole device holds at once."""
        from .kernels.launch import kernel_entry
        from .occupancy import resident_ctas

        return resident_ctas(bytes(compiled.cubin), kernel_entry(compiled.ptx), compiled.threads,
                             device.index, compiled.smem)


KERNELS = DeviceKernels()


class HeadGather:
    """``gather(logits, stock)``: the Lamport gather for ``rows``; ``stock`` otherwise.

    ``rows``: the row counts served, with ``ctas`` None (a heuristic), an int for every
    row count, or ``{rows: ctas or GatherConfig}``; or ``rows`` maps each row count to
    its ``GatherConfig`` (``ctas`` None): a plan built beforehand (``plan.plan``, a
    table's ``{m: p.config}``). ``threads``/``unroll`` apply where no GatherConfig is
    given. ``mailbox``: a ``LocalMailbox`` shared by virtual ranks (one-GPU emulation);
    None builds this rank's mailbox over ``group`` (None: the default group) with the
    ``backend`` chosen by ``mailbox.choose_backend``. ``configs``: the plan served,
    ``{rows: GatherConfig}``; ``ctas``: its CTA counts. ``pdl``: None takes it where
    the architecture has it (sm_90 on).

    ``clamp``: a row whose CTAs cannot all be co-resident is cut to the limit (and
    listed in ``clamped``, ``{rows: (asked, limit)}``) instead of refusing the whole
    gather; the limit is a fact of the GPU model and the kernel, so every rank cuts
    alike.

    ``mode``, one explicit choice (``kernels.protocol`` has the protocol of each):
    ``"recoverable"`` (tools, tuning, tests: a give-up hands out NaN for two calls,
    then every rank raises ``GatherTimeout`` until a collective ``reset()``) or
    ``"serving"`` (engines, which never call ``check()``: a give-up stops this
    process's GPU context before any later kernel can use the step, and a watcher
    logs the missing ranks from the status record)."""

    def __init__(self, group, device, tp, rank, shard, rows, ctas=None, *, mailbox=None,
                 threads=DEFAULT_THREADS, unroll=None, pdl=None,
                 budget_s=SPIN_BUDGET_S, backend=None, mode=RECOVERABLE, clamp=False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.clamped = {} if clamp else None
        if isinstance(rows, Mapping):
            if ctas is not None:
                raise ValueError("rows maps row counts to GatherConfigs: pass no ctas")
            rows, ctas = rows.keys(), dict(rows)
        self.group = group
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        knobs = dict(threads=threads, unroll=unroll)
        if mailbox is not None:  # emulated: one process, nothing to agree on
            if mailbox.tp != tp or mailbox.words != tp * shard // 2:
                raise ValueError("the shared mailbox does not fit this gather")
            self._prepare(tp, rank, shard, rows, ctas, knobs, pdl, mailbox.sharing, budget_s)
            if mailbox.cap < self.cap:
                raise ValueError(f"the shared mailbox holds {mailbox.cap} rows, not {self.cap}")
            self.box = mailbox
        else:
            # Each step below can fail or block on one rank alone: it runs under the
            # start-up deadline (``_start_up``: the rendezvous', ``mailbox.RENDEZVOUS_WAIT_S``)
            # and the ranks agree after it, so a rank blocking in one takes every rank to
            # the same error within that deadline instead of holding them in the next
            # collective (gloo's own timeout: 30 min).
            def bounded(what, fn, *args):
                return attempt(self._start_up, what, fn, *args)

            # the backend and how many ranks share this GPU: gathered facts, the same
            # on every rank (a rank whose facts failed makes every rank raise)
            backend_of, error = bounded("describing the ranks' GPUs", choose_backend, group,
                                        self.device, backend)
            agree(error, group, self.device, "to describe its GPU")
            kind, sharing = backend_of
            _, error = bounded("building the gather (checks, compile, occupancy)", self._prepare,
                               tp, rank, shard, rows, ctas, knobs, pdl, sharing, budget_s)
            agree(error, group, self.device, "to build the gather (checks, compile, occupancy)")
            box, error = bounded(f"allocating its {kind} mailbox", MAILBOXES[kind], group,
                                 self.device, tp, rank, self.cap, self.width // 2)
            try:
                agree(error, group, self.device, f"to allocate its {kind} mailbox")
                _, error = bounded(f"mapping the peers' {kind} mailboxes", box.connect)
                agree(error, group, self.device, f"to map the peers' {kind} mailboxes")

                def arm():
                    box.arm()
                    torch.cuda.synchronize(self.device)

                _, error = bounded("arming its mailbox", arm)
                agree(error, group, self.device, "to arm its mailbox")  # also: every rank armed
            except BaseException:
                # A build that failed frees this rank's box and mappings now (no gather
                # ran: nothing can still push), unless this rank's own step was given up
                # on: its helper thread may still be inside the box; it stays.
                if box is not None and not isinstance(error, TimeoutError):
                    attempt(box.discard)
                raise
            self.box = box
        self._peers = self.box.peers.data_ptr()  # the kernel reads the table by address
        self._closed = False
        self._stream_id, self._stream = None, None
        # serving: the engine's own error cannot name the ranks once the context stopped
        # and a trap that never surfaces must not leave the engine waiting: the watchdog
        # (the slow heartbeat comes at half the budget; the trap is due at 7/8)
        self._watcher = Watcher(self._status, device=self.device,
                                stop_after_s=trap_grace(budget_s) + STOP_GRACE_S,
                                stuck_after_s=slow_after(budget_s) + STOP_GRACE_S) \
            if mode == SERVING else None

    def _start_up(self, what, fn, *args):
        """``fn(*args)``, one start-up step of this rank, under the start-up deadline
        (``mailbox.RENDEZVOUS_WAIT_S``, read now): ``collective.step`` (its collectives
        stay on this thread; a step given up on never enters one later), with this
        gather's CUDA device current in its threads."""
        from .mailbox import RENDEZVOUS_WAIT_S

        scope = (lambda: torch.cuda.device(self.device)) if self.device.type == "cuda" else None
        return step(RENDEZVOUS_WAIT_S, f"lamport-head start-up: {what}", fn, *args, scope=scope)

    def _prepare(self, tp, rank, shard, rows, ctas, knobs, pdl, sharing, budget_s):
        """Everything that can fail on this rank alone: checks, the plan (compile,
        occupancy), the host-visible status record."""
        if tp < 2 or not 0 <= rank < tp:
            raise ValueError(f"need tp >= 2 and 0 <= rank < tp, got tp={tp} rank={rank}")
        if shard <= 0 or shard % FRAGMENT_BF16:
            raise ValueError(f"shard width {shard} is not a positive multiple of {FRAGMENT_BF16}")
        self._kernels = KERNELS
        self._arch = self._kernels.arch(self.device)
        self.tp, self.rank, self.shard, self.width = tp, rank, shard, tp * shard
        # what Tensor.get_device() answers for a tensor on this device (-1: the CPU)
        self._index = self.device.index if self.device.type == "cuda" else -1
        self._pdl = self._kernels.pdl(self._arch) if pdl is None else bool(pdl)
        self.sharing = sharing
        self.configs = plan(rows, ctas, tp=tp, shard=shard, resident=self._resident,
                            sharing=sharing, pdl=self._pdl, clamped=self.clamped, **knobs)
        self.rows = frozenset(self.configs)
        self.cap = max(self.rows)
        self.ctas = {m: c.ctas for m, c in self.configs.items()}
        self._launch = {m: self._kernels.launcher(self._compiled(c), self.device)
                        for m, c in self.configs.items()}
        self._open_status(budget_s)

    def _open_status(self, budget_s):
        """The spin budget and the host-visible status record (``status.StatusRecord``:
        the kernel writes it, the host reads it with no device sync)."""
        if not budget_s > 0:
            raise ValueError(f"the spin budget must be a positive number of seconds, got {budget_s!r}")
        self.budget_ns = int(budget_s * 1e9)
        self._status = StatusRecord(self.rank, self.tp)
        self._status_address = self._status.address

    def _compiled(self, config):
        return self._kernels.compiled(self.tp, self.shard, config, self._pdl, self._arch,
                                      stop=self.mode == SERVING)

    def _resident(self, config):
        return self._kernels.resident(self._compiled(config), self.device)

    def resident(self, threads=DEFAULT_THREADS, unroll=DEFAULT_UNROLL):
        """CTAs per rank of this kernel shape that fit on the device alongside the
        ranks sharing it (``plan.co_resident_limit``): the most ``plan`` accepts."""
        config = GatherConfig(1, threads, unroll)
        return co_resident_limit(self._resident(config), self.sharing, self._pdl)

    def poll(self):
        """Raise ``GatherTimeout`` if this rank's host flag is up (a host-memory read,
        no device sync): what every call does first. A graph replay that holds this
        gather's launch runs no ``__call__``, so whoever replays it calls ``poll()``
        before each replay (``lamport_head.engines.sglang`` does, on the ModelRunner's
        ``forward``), or a failed peer would go on delivering NaN unnoticed."""
        if self._status.raised:
            raise self.failure()

    def __call__(self, logits, stock):
        self.poll()
        shape = logits.shape
        if (len(shape) != 2 or shape[1] != self.shard or logits.dtype != torch.bfloat16):
            return stock(logits)
        launch = self._launch.get(shape[0])
        if launch is None:
            return stock(logits)
        if self._closed:
            raise RuntimeError("lamport-head: this gather was closed")
        if logits.get_device() != self._index:
            raise ValueError(f"lamport-head: logits on device {logits.device}, the gather "
                             f"serves cuda:{self._index}")
        if not logits.is_contiguous() or logits.data_ptr() % 16:
            # Where a tensor sits is the allocator's choice and may differ by rank: copy,
            # never take stock alone (every rank must run the same collective).
            logits = logits.clone(memory_format=torch.contiguous_format)
        stream = self._follow_stream()
        out = logits.new_empty((shape[0], self.width))  # under capture: the graph's own
        launch(logits, out.data_ptr(), self._peers, self.rank, self.ctas[shape[0]],
               self.budget_ns, self._status_address, stream)
        return out

    def _follow_stream(self):
        """Keep every call in one stream order: a call on a new stream waits first
        for the calls issued on the previous one. Returns the current stream's raw
        handle (what the launch goes to)."""
        now = self._stream_handle()
        if now != self._stream_id:
            current = torch.cuda.current_stream(self.device)
            # A capture may not wait on work outside it; its replays are ordered by the
            # stream the caller launches them on.
            if self._stream is not None and not torch.cuda.is_current_stream_capturing():
                current.wait_stream(self._stream)
            self._stream_id, self._stream = now, current
        return now

    def _stream_handle(self):
        """The raw handle of the current stream (no Stream object: this is per call)."""
        return (_raw_stream(self._index) if _raw_stream is not None
                else torch.cuda.current_stream(self.device).cuda_stream)

    def launch(self, logits, out, ctas):
        """The bare kernel launch into ``out`` on the current stream, with no checks:
        explicitly poisoned outputs in tests, CTA counts outside the plan in tuning."""
        launch = self._launch[logits.shape[0]]
        launch(logits, out.data_ptr(), self._peers, self.rank, ctas, self.budget_ns,
               self._status_address, self._stream_handle())

    def failure(self):
        """The ``GatherTimeout`` this rank's status record describes (host memory: it
        reads right with the GPU context stopped, as a serving give-up leaves it)."""
        return self._status.failure(stopped=self.mode == SERVING)

    def check(self):
        """Raise ``GatherTimeout`` if a call of any rank gave up: the host flag (set by
        this rank's calls after the failed one), else the mark in this rank's own
        mailbox (set by the rank that gave up; read after a device sync)."""
        self.poll()
        torch.cuda.synchronize(self.device)
        control = self.box.control(self.rank).tolist()
        if control[CONTROL_MARK]:
            missing = [r for r in range(self.tp) if control[CONTROL_MISSING + r]]
            raise GatherTimeout(self.rank, missing, MARK_TOP - control[CONTROL_MARK])

    def reset(self):
        """Collective: every rank (emulated: every virtual rank's gather) calls it.

        stop (the caller issues no gather) -> device sync (this rank's kernels, and
        so its late pushes, are done) -> barrier (every rank's are) -> arm the box and
        clear the mark and the status -> sync -> barrier (nobody pushes before every
        box is armed)."""
        torch.cuda.synchronize(self.device)
        self.box.barrier()
        self.box.arm()
        self._status.clear()
        torch.cuda.synchronize(self.device)
        self.box.barrier()

    def close(self):
        """Collective: release the mailbox once no peer can push into it. A serving
        gather that gave up raises its failure instead: its context stopped (or the
        watchdog is about to end the process), so there is nothing to release and a
        sync could wait for ever; the watchdog stays on."""
        self._closed = True
        if self.mode == SERVING and self._status.raised:
            raise self.failure()
        if self._watcher is not None:
            self._watcher.stop()
        self.box.close()
