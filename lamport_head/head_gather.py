"""HeadGather: the vocab-parallel lm_head's gather ``[M, V/TP] -> [M, V]`` (BF16, or
FP32 from an FP32 lm_head: one dtype a gather) for a set of row counts, on two parities
of a Lamport mailbox.

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
  2-D, not the gather's dtype (``dtype``), the wrong width. The decision depends on
  the shape and dtype only, so every rank takes the same path (and a captured graph
  holds the same path on every rank);
  a non-contiguous or unaligned tensor (the allocator's choice, which may differ by
  rank) is copied, a negative- or conjugate-bit view is resolved first (the kernel
  reads the storage, which holds the bits before the lazy negation: it would gather
  x where the engine holds -x), and a tensor on another device raises.
- Bytes move unchanged but for the sentinel word 0x80000000 (``dtypes``): the BF16
  pair (+0, -0) arrives as (+0, +0), an FP32 -0.0 as +0.0.
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
- Fail-stop, recoverable mode (tools, tuning, tests; asked for by name, never a
  default: an engine that forgot ``check()`` would hand on NaN): a wait past the
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
- What each row count launches is ``plan.plan``'s answer, checked against the
  occupancy limit (every CTA of every rank sharing the device resident at once);
  construction is ``build.build`` (kernels, limit, launch flag, the collective build:
  the one build path install, the emulation and the tuner share). What is here is
  the per-call object: checks, launch, stream order, poll and failure, reset, close.
"""

import torch

from . import build
from .config import GatherConfig
from .kernels.protocol import (CONTROL_MARK, CONTROL_MISSING, DEFAULT_THREADS, DEFAULT_UNROLL,
                               MARK_TOP, slow_after, trap_grace)
from .settings import SPIN_BUDGET_S
from .status import SERVING, STOP_GRACE_S, GatherTimeout, Watcher

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class HeadGather:
    """``gather(logits, stock)``: the Lamport gather for ``rows``; ``stock`` otherwise.

    ``rows``: the row counts served, with ``ctas`` what is asked for each: None (a
    heuristic), an int (a CTA count) for every row count, or ``{rows: CTA count or
    GatherConfig}``; or ``rows`` is a plan, each row count's ``GatherConfig`` (``ctas``
    None), built beforehand (``plan.plan``, or the configs of a table's enabled entries,
    ``{m: e.config}``). ``threads``/``unroll`` apply where no GatherConfig is given.
    ``mailbox``: a ``LocalMailbox`` shared by virtual ranks (one-GPU emulation); None
    builds this rank's mailbox over ``group`` (None: the default group) with the
    ``backend`` chosen by ``mailbox.choose_backend``. ``configs``: the plan served,
    ``{rows: GatherConfig}``; ``ctas``: its CTA counts, ``{rows: int}``. ``pdl``: None
    takes it where the architecture has it (sm_90 on). ``dtype``: the logits' dtype
    this gather serves (``torch.bfloat16`` or ``torch.float32``; ``shard`` whole
    16-byte fragments of it); a call of another dtype takes ``stock``.

    ``clamp``: a row whose CTAs cannot all be co-resident is cut to the limit (and
    listed in ``clamped``, ``{rows: (asked, limit)}``) instead of refusing the whole
    gather; the limit is a fact of the GPU model and the kernel, so every rank cuts
    alike.

    ``mode``, one explicit choice with no default (``kernels.protocol`` has the protocol
    of each). Neither is safe for every caller: a default of ``"recoverable"`` hands a
    direct user that never calls ``check()`` NaN for two calls after a peer fails, and
    a default of ``"serving"`` stops the GPU context of a tool that meant to recover;
    so the caller names the one its loop is written for:
    ``"recoverable"`` (tools, tuning, tests: a give-up hands out NaN for two calls,
    then every rank raises ``GatherTimeout`` until a collective ``reset()``) or
    ``"serving"`` (engines, which never call ``check()``: a give-up stops this
    process's GPU context before any later kernel can use the step, and a watcher
    logs the missing ranks from the status record)."""

    def __init__(self, group, device, tp, rank, shard, rows, ctas=None, *, mailbox=None,
                 threads=DEFAULT_THREADS, unroll=None, pdl=None,
                 budget_s=SPIN_BUDGET_S, backend=None, mode, clamp=False,
                 dtype=torch.bfloat16):
        built = build.build(group, device, tp, rank, shard, rows, ctas, mailbox=mailbox,
                            backend=backend, mode=mode, pdl=pdl, budget_s=budget_s, clamp=clamp,
                            threads=threads, unroll=unroll, dtype=dtype)
        self.dtype = built.dtype  # the one logits dtype served (a torch dtype)
        self.group, self.device, self.mode, self.kernels = group, built.device, mode, built.kernels
        self.serving = build.launch_flag(mode)  # the kernel's argument every launch passes
        self.tp, self.rank, self.shard, self.width = tp, rank, shard, tp * shard
        self.sharing, self.configs, self.clamped = built.sharing, built.configs, built.clamped
        self.rows, self.cap = frozenset(self.configs), built.cap
        self.ctas = {m: c.ctas for m, c in self.configs.items()}
        self.box, self._launch, self._status = built.box, built.launchers, built.status
        self.budget_ns, self.status_address = built.budget_ns, built.status.address
        self.peers_address = self.box.peers.data_ptr()  # the kernel reads the table by address
        # what Tensor.get_device() answers for a tensor on this device (-1: the CPU)
        self._index = self.device.index if self.device.type == "cuda" else -1
        self._closed = False
        self._stream_id, self._stream = None, None
        # serving: the engine's own error cannot name the ranks once the context stopped
        # and a trap that never surfaces must not leave the engine waiting: the watchdog
        # (the slow heartbeat comes at half the budget; the trap is due at 7/8)
        self._watcher = Watcher(self._status, device=self.device,
                                stop_after_s=trap_grace(budget_s) + STOP_GRACE_S,
                                stuck_after_s=slow_after(budget_s) + STOP_GRACE_S) \
            if mode == SERVING else None

    def resident(self, threads=DEFAULT_THREADS, unroll=DEFAULT_UNROLL):
        """CTAs per rank of this kernel shape that fit on the device alongside the
        ranks sharing it (``build.Kernels.limit``): the most ``plan`` accepts."""
        return self.kernels.limit(GatherConfig(1, threads, unroll), self.sharing)

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
        if (len(shape) != 2 or shape[1] != self.shard or logits.dtype != self.dtype):
            return stock(logits)
        launch = self._launch.get(shape[0])
        if launch is None:
            return stock(logits)
        if self._closed:
            raise RuntimeError("lamport-head: this gather was closed")
        if logits.get_device() != self._index:
            raise ValueError(f"lamport-head: logits on device {logits.device}, the gather "
                             f"serves cuda:{self._index}")
        if logits.is_neg() or logits.is_conj():
            # A lazy view's storage holds the bits before its negation, and the kernel
            # reads storage: resolved here, the same on every rank (a fact of the call).
            logits = logits.resolve_neg().resolve_conj()
        if not logits.is_contiguous() or logits.data_ptr() % 16:
            # Where a tensor sits is the allocator's choice and may differ by rank: copy,
            # never take stock alone (every rank must run the same collective).
            logits = logits.clone(memory_format=torch.contiguous_format)
        stream = self._follow_stream()
        out = logits.new_empty((shape[0], self.width))  # under capture: the graph's own
        launch(logits, out.data_ptr(), self.peers_address, self.rank, self.ctas[shape[0]],
               self.budget_ns, self.status_address, stream)
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
        launch(logits, out.data_ptr(), self.peers_address, self.rank, ctas, self.budget_ns,
               self.status_address, self._stream_handle())

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
