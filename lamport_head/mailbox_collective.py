"""The base the gather and the all-to-all share (docs/design.md, "The public contract").
Every rank launches in the same order; whether a call is served depends only on facts
every rank shares (shape, dtype, M), and what may differ by rank is resolved by a copy,
never by taking stock alone."""

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
    """How a collective is built: ``mailbox`` a shared ``LocalMailbox`` (emulation); ``pdl``
    None where the architecture has it; ``clamp`` cuts a row over the co-resident limit to
    it (listed in ``clamped``); ``threads``/``unroll`` shape ``default``'s plan."""

    mailbox: object = None
    backend: object = None
    pdl: object = None
    budget_s: float = SPIN_BUDGET_S
    clamp: bool = False
    threads: int = DEFAULT_THREADS
    unroll: object = None


class MailboxCollective:
    """The base of ``HeadGather`` and ``AllToAll`` (``all_to_all`` names the kernel); ``mode``
    has no default; ``dtype`` is the one dtype served."""

    all_to_all = None

    @classmethod
    def _kernel_mode(cls):
        if cls.all_to_all is None:
            raise TypeError("lamport-head: MailboxCollective is a base; build HeadGather "
                            "or AllToAll")
        return cls.all_to_all

    def __init__(self, group, device, tp, rank, shard_width, plan, *, mode, dtype=torch.bfloat16,
                 setup=None):
        self._build_for(group, device, tp, rank, shard_width, lambda limit: plan, mode, dtype,
                        setup or Setup())

    @classmethod
    def default(cls, group, device, tp, rank, shard_width, row_counts, *, mode, dtype=torch.bfloat16,
                setup=None):
        """On the heuristic's plan for ``row_counts``, once the co-resident limit is known."""
        setup = setup or Setup()
        gather = cls.__new__(cls)
        plan_for = partial(plans.default, row_counts, tp=tp, shard_width=shard_width,
                           threads=setup.threads, unroll=setup.unroll, dtype=dtype)
        gather._build_for(group, device, tp, rank, shard_width, plan_for, mode, dtype, setup)
        return gather

    def _build_for(self, group, device, tp, rank, shard_width, plan_for, mode, dtype, setup):
        """Build (``build.build``, ``plan_for(limit)`` the plan) and serve: the one path of
        both constructors."""
        self._serve(build.build(group, device, tp, rank, shard_width, plan_for,
                                mailbox=setup.mailbox, backend=setup.backend, mode=mode,
                                pdl=setup.pdl, budget_s=setup.budget_s, clamp=setup.clamp,
                                dtype=dtype, all_to_all=self._kernel_mode()), group)

    def _serve(self, built, group):
        self.group, self.device, self.mode, self.kernels = group, built.device, built.mode, \
            built.kernels
        self.tp, self.rank, self.shard_width, self.width = built.tp, built.rank, built.shard_width, \
            built.tp * built.shard_width
        self.sharing, self.plan, self.clamped = built.sharing, built.plan, built.clamped
        self.dtype = built.dtype
        self.rows, self.cap = self.plan.row_counts, built.cap
        self._ctas = self.plan.ctas
        self.box, self._launch, self._status = built.box, built.launchers, built.status
        self.budget_ns, self.status_address = built.budget_ns, built.status.address
        self.peers_address = self.box.peers.data_ptr()
        self._index = self.device.index if self.device.type == "cuda" else -1
        self._closed = False
        self._stream_id, self._stream = None, None
        # serving's watcher: names the missing ranks once the context stopped; the watchdog
        budget_s = self.budget_ns / 1e9
        self._watcher = Watcher(self._status, device=self.device,
                                stop_after_s=trap_grace(budget_s) + STOP_GRACE_S,
                                stuck_after_s=slow_after(budget_s) + STOP_GRACE_S) \
            if self.mode == SERVING else None

    def resident(self, threads=DEFAULT_THREADS, unroll=DEFAULT_UNROLL):
        """CTAs per rank of this kernel shape that fit beside the ranks sharing the device."""
        return self.kernels.limit(self.sharing)(GatherConfig(1, threads, unroll))

    def poll(self):
        """Raise ``GatherTimeout`` if this rank's host flag is up (no device sync). A graph
        replay runs no ``__call__``: whoever replays one calls ``poll()`` before each."""
        if self._status.raised:
            raise self.failure()

    def _ready(self, logits):
        if self._closed:
            raise RuntimeError("lamport-head: this gather was closed")
        if logits.get_device() != self._index:
            raise ValueError(f"lamport-head: logits on device {logits.device}, the gather "
                             f"serves cuda:{self._index}")
        if logits.is_neg() or logits.is_conj():
            # the kernel reads storage, which holds the bits before the negation
            logits = logits.resolve_neg().resolve_conj()
        if not logits.is_contiguous() or logits.data_ptr() % 16:
            # where a tensor sits may differ by rank: copy, never take stock alone
            logits = logits.clone(memory_format=torch.contiguous_format)
        return logits

    def _follow_stream(self):
        """The current stream's raw handle; a new stream first waits for the previous one."""
        now = self._stream_handle()
        if now != self._stream_id:
            current = torch.cuda.current_stream(self.device)
            # a capture may not wait on work outside it
            if self._stream is not None and not torch.cuda.is_current_stream_capturing():
                current.wait_stream(self._stream)
            self._stream_id, self._stream = now, current
        return now

    def _stream_handle(self):
        return (_raw_stream(self._index) if _raw_stream is not None
                else torch.cuda.current_stream(self.device).cuda_stream)

    def failure(self):
        """The ``GatherTimeout`` of this rank's status record (read with the context stopped)."""
        return self._status.failure(stopped=self.mode == SERVING)

    def check(self):
        """Raise ``GatherTimeout`` if a call of any rank gave up: the host flag, else the mark
        in this rank's mailbox (after a device sync)."""
        self.poll()
        torch.cuda.synchronize(self.device)
        control = self.box.control(self.rank).tolist()
        if control[CONTROL_MARK]:
            missing = [r for r in range(self.tp) if control[CONTROL_MISSING + r]]
            raise GatherTimeout(self.rank, missing, MARK_TOP - control[CONTROL_MARK])

    def reset(self):
        """Collective, the caller issuing no gather: sync, barrier (no late push is left), arm
        and clear, sync, barrier (nobody pushes before every box is armed)."""
        torch.cuda.synchronize(self.device)
        self.box.barrier()
        self.box.arm()
        self._status.clear()
        torch.cuda.synchronize(self.device)
        self.box.barrier()

    def close(self):
        """Collective: release the mailbox once no peer can push into it. A serving gather
        that gave up raises its failure instead: its context is stopped, a sync could hang;
        the watchdog stays on."""
        self._closed = True
        if self.mode == SERVING and self._status.raised:
            raise self.failure()
        if self._watcher is not None:
            self._watcher.stop()
        self.box.close()
