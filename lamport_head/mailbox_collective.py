"""What the gather (``HeadGather``) and the all-to-all (``AllToAll``) share, as siblings
of one base: the build, the mailbox, the two modes, the per-call checks of a shard, the
stream order and ``poll``/``check``/``failure``/``reset``/``close``. Each sibling has its
own call and bare launch; which kernel it builds is its class's ``all_to_all``
(``kernels.gather.Gather``'s mode).

Invariants a change must keep (docs/design.md: the protocol and the fail-stop rule):

- Every rank launches in the same order (the model runner's); parity alternates per
  launch, kept by the kernel (the rank's epoch in device memory), so graph replays and
  eager calls interleave on one stream. An eager call on another stream first waits
  for the previous one.
- Whether a call is served depends on facts every rank shares (its shape, dtype and,
  for the all-to-all, M), so every rank takes the same path; what may differ by rank
  (a non-contiguous or unaligned tensor, a lazy negation) is resolved by a copy, never
  by taking stock alone. A tensor on another device raises.
- Bytes move unchanged but for the sentinel word 0x80000000 (``dtypes``): the BF16
  pair (+0, -0) arrives as (+0, +0), an FP32 -0.0 as +0.0.
- ``mode`` has no default (``kernels.protocol`` has each): ``"serving"`` (engines,
  which never call ``check()``: a give-up stops this process's GPU context, the
  watcher names the missing ranks and is the watchdog) or ``"recoverable"`` (tools,
  tests, tuning: a give-up hands out NaN for two calls, then every rank raises
  ``GatherTimeout`` until a collective ``reset()``). No rank switches to stock alone.
- Construction is ``build.build``: collective on real ranks, under the start-up
  deadline, never stranding a peer.
"""

from dataclasses import dataclass
from functools import partial

import torch

from . import build, plan as plans
from .config import GatherConfig
from .kernels.protocol import (CONTROL_MARK, CONTROL_MISSING, DEFAULT_THREADS, DEFAULT_UNROLL,
                               MARK_TOP, slow_after, trap_grace)
from .settings import SPIN_BUDGET_S
from .status import SERVING, STOP_GRACE_S, GatherTimeout, Watcher

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@dataclass(frozen=True)
class Setup:
    """How a collective is built, beyond who the ranks are, the shard, the plan, the
    mode and the dtype. ``mailbox``: a ``LocalMailbox`` shared by virtual ranks (one-GPU
    emulation); None builds this rank's over the group with the ``backend``
    ``mailbox.choose_backend`` picks. ``pdl``: None takes it where the architecture has
    it. ``budget_s``: the spin budget. ``clamp``: a row whose CTAs cannot all be
    co-resident is cut to the limit (listed in ``clamped``, ``{rows: (asked,
    limit)}``) instead of refusing. ``threads``/``unroll``: the CTA shape of
    ``default``'s heuristic plan."""

    mailbox: object = None
    backend: object = None
    pdl: object = None
    budget_s: float = SPIN_BUDGET_S
    clamp: bool = False
    threads: int = DEFAULT_THREADS
    unroll: object = None


class MailboxCollective:
    """The base of ``HeadGather`` and ``AllToAll`` (not built alone: a sibling names its
    kernel). ``plan``: ``{rows: GatherConfig}`` (a table's enabled entries' configs,
    ``plan.uniform``); ``default`` builds the built-in heuristic's for ``row_counts``.
    ``mode``: ``"serving"`` or ``"recoverable"``, no default. ``dtype``: the one logits
    dtype served (``torch.bfloat16`` or ``torch.float32``; ``shard`` whole 16-byte
    fragments of it); a call of another takes ``stock``. ``setup``: how it is built
    (``Setup``). ``plan`` (the attribute): the plan served."""

    all_to_all = None  # the kernel's mode: each sibling's own (False: the gather)

    @classmethod
    def _kernel_mode(cls):
        """The sibling's kernel mode; the base names none (a collective build for
        nothing): checked before any build."""
        if cls.all_to_all is None:
            raise TypeError("lamport-head: MailboxCollective is a base; build HeadGather "
                            "or AllToAll")
        return cls.all_to_all

    def __init__(self, group, device, tp, rank, shard_width, plan, *, mode, dtype=torch.bfloat16,
                 setup=None):
        setup = setup or Setup()
        self._serve(build.build(group, device, tp, rank, shard_width, lambda limit: plan,
                                mailbox=setup.mailbox, backend=setup.backend, mode=mode,
                                pdl=setup.pdl, budget_s=setup.budget_s, clamp=setup.clamp,
                                dtype=dtype, all_to_all=self._kernel_mode()), group)

    @classmethod
    def default(cls, group, device, tp, rank, shard_width, row_counts, *, mode, dtype=torch.bfloat16,
                setup=None):
        """The collective of ``row_counts`` on the built-in heuristic's plan
        (``plan.default``, of ``setup``'s threads and unroll), chosen once the
        device's co-resident limit is known."""
        setup = setup or Setup()
        gather = cls.__new__(cls)
        plan_for = partial(plans.default, row_counts, tp=tp, shard_width=shard_width,
                           threads=setup.threads, unroll=setup.unroll, dtype=dtype)
        gather._serve(build.build(group, device, tp, rank, shard_width, plan_for, mailbox=setup.mailbox,
                                  backend=setup.backend, mode=mode, pdl=setup.pdl,
                                  budget_s=setup.budget_s, dtype=dtype,
                                  all_to_all=cls._kernel_mode()), group)
        return gather

    def _serve(self, built, group):
        self.group, self.device, self.mode, self.kernels = group, built.device, built.mode, \
            built.kernels
        self.tp, self.rank, self.shard_width, self.width = built.tp, built.rank, built.shard_width, \
            built.tp * built.shard_width
        self.sharing, self.plan, self.clamped = built.sharing, built.plan, built.clamped
        self.dtype = built.dtype  # the one logits dtype served (a torch dtype)
        self.rows, self.cap = self.plan.row_counts, built.cap
        self._ctas = self.plan.ctas  # read per call
        self.box, self._launch, self._status = built.box, built.launchers, built.status
        self.budget_ns, self.status_address = built.budget_ns, built.status.address
        self.peers_address = self.box.peers.data_ptr()  # the kernel reads the table by address
        # what Tensor.get_device() answers for a tensor on this device (-1: the CPU)
        self._index = self.device.index if self.device.type == "cuda" else -1
        self._closed = False
        self._stream_id, self._stream = None, None
        # serving: once the context stopped the engine's own error cannot name the ranks,
        # and a trap that never surfaces must not leave the engine waiting: the watchdog
        budget_s = self.budget_ns / 1e9
        self._watcher = Watcher(self._status, device=self.device,
                                stop_after_s=trap_grace(budget_s) + STOP_GRACE_S,
                                stuck_after_s=slow_after(budget_s) + STOP_GRACE_S) \
            if self.mode == SERVING else None

    def resident(self, threads=DEFAULT_THREADS, unroll=DEFAULT_UNROLL):
        """CTAs per rank of this kernel shape that fit on the device alongside the
        ranks sharing it (``build.Kernels.limit``): the most ``plan`` accepts."""
        return self.kernels.limit(self.sharing)(GatherConfig(1, threads, unroll))

    def poll(self):
        """Raise ``GatherTimeout`` if this rank's host flag is up (a host-memory read,
        no device sync): what every call does first. A graph replay that holds this
        gather's launch runs no ``__call__``, so whoever replays it calls ``poll()``
        before each replay (``lamport_head.engines.sglang`` does, on the ModelRunner's
        ``forward``), or a failed peer would go on delivering NaN unnoticed."""
        if self._status.raised:
            raise self.failure()

    def _ready(self, logits):
        """A served call's shard as the kernel reads it (contiguous, 16-byte aligned, no
        lazy negation), on this gather's device, the gather open."""
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
        return logits

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
