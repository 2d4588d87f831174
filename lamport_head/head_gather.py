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
  2-D, not BF16, the wrong width, another device, non-contiguous, not 16-byte aligned.
  The decision depends on the shape only, so every rank takes the same path, and a
  captured graph holds the same path on every rank.
- Bytes move unchanged but for the sentinel word (+0, -0), which arrives as (+0, +0).
- Fail-stop: a wait past the spin budget writes the missing fragments as NaN and
  marks every rank's mailbox; from then on every rank's next call (and ``check()``)
  raises ``GatherTimeout``, and keeps raising until a collective ``reset()``. No rank
  ever switches to ``stock`` on its own.
- Construction is collective on real ranks, and never strands a peer: the local
  part (checks, compile, occupancy, allocation) runs first, the ranks agree, then the
  mailboxes are mapped, the ranks agree again, arm, and meet at a barrier.
"""

import ctypes
import math

import torch

from .collective import agree, attempt
from .kernels.protocol import (CAUSE_ABORT, DEFAULT_THREADS, DEFAULT_UNROLL, FRAGMENT_BF16,
                               STATUS_CAUSE, STATUS_PARITY, STATUS_PEERS, STATUS_WORDS)
from .mailbox import ROWS, choose_backend

BUDGET_S = 2.0  # default spin budget per call
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class GatherTimeout(RuntimeError):
    """A gather gave up on fragments some peers never pushed (this rank's own wait
    ran out, or a peer's did and marked every rank)."""

    def __init__(self, rank, peers, parity, cause):
        self.rank, self.peers, self.parity, self.cause = rank, tuple(peers), parity, cause
        names = ", ".join(str(p) for p in self.peers) or "unknown"
        how = "stopped by a peer's time-out" if cause == CAUSE_ABORT else "timed out"
        super().__init__(
            f"lamport-head gather on rank {rank} {how}: rank(s) {names} never published "
            f"(parity {parity}); every rank raises until a collective reset()")


def default_ctas(rows: int, tp: int, shard: int, threads: int, unroll: int, limit: int) -> int:
    """Enough CTAs that each thread polls about ``unroll`` fragments, within ``limit``."""
    fragments = rows * (tp - 1) * (shard // FRAGMENT_BF16)
    return max(1, min(limit, math.ceil(fragments / (threads * unroll))))


class HeadGather:
    """``gather(logits, stock)``: the Lamport gather for ``rows``; ``stock`` otherwise.

    ``ctas``: None (a heuristic), an int for every row count, or ``{rows: ctas}``.
    ``mailbox``: a ``LocalRows`` shared by virtual ranks (one-GPU emulation); None
    builds this rank's mailbox over ``group`` (None: the default group) with the
    ``backend`` chosen by ``mailbox.choose_backend``."""

    def __init__(self, group, device, tp, rank, shard, rows, ctas=None, *, mailbox=None,
                 threads=DEFAULT_THREADS, unroll=DEFAULT_UNROLL, pdl=True, budget_s=BUDGET_S,
                 backend=None):
        self.group = group
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        _, error = attempt(self._prepare, tp, rank, shard, rows, ctas, threads, unroll, pdl,
                           mailbox)
        if mailbox is not None:  # emulated: one process, nothing to agree on
            if error is not None:
                raise error
            self.box = mailbox
        else:
            agree(error, group, self.device, "to build the gather (checks, compile, occupancy)")
            kind = choose_backend(group, self.device, backend)
            box, error = attempt(ROWS[kind], group, self.device, tp, rank, self.cap,
                                 self.width // 2)
            agree(error, group, self.device, f"to allocate its {kind} mailbox")
            _, error = attempt(box.connect)
            agree(error, group, self.device, f"to map the peers' {kind} mailboxes")
            box.arm()
            torch.cuda.synchronize(self.device)
            box.barrier()  # no rank pushes before every rank armed
            self.box = box
        self._peers = self.box.peers.data_ptr()  # the kernel reads the table by address
        self.budget_ns = int(budget_s * 1e9)
        # Host-visible status record (pinned: the kernel writes it, the host reads it
        # with no device sync); layout in kernels.protocol.
        self._status = torch.zeros(STATUS_WORDS, dtype=torch.int32,
                                   pin_memory=torch.cuda.is_available())
        self._status_address = self._status.data_ptr()
        self._flag = ctypes.c_int32.from_address(self._status_address)
        self._stream_id, self._stream = None, None

    def _prepare(self, tp, rank, shard, rows, ctas, threads, unroll, pdl, mailbox):
        """Everything that can fail on this rank alone: checks, compile, occupancy."""
        rows = frozenset(int(r) for r in rows)
        if not rows or min(rows) < 1:
            raise ValueError(f"rows must be a non-empty set of positive row counts, got {sorted(rows)}")
        if tp < 2 or not 0 <= rank < tp:
            raise ValueError(f"need tp >= 2 and 0 <= rank < tp, got tp={tp} rank={rank}")
        if shard <= 0 or shard % FRAGMENT_BF16:
            raise ValueError(f"shard width {shard} is not a positive multiple of {FRAGMENT_BF16}")
        if self.device.type != "cuda":
            raise ValueError(f"HeadGather needs a CUDA device, got {self.device}")
        self.tp, self.rank, self.shard, self.width = tp, rank, shard, tp * shard
        self._index = self.device.index
        self.rows, self.cap = rows, max(rows)
        self.parity = 0
        major, minor = torch.cuda.get_device_capability(self.device)
        self._arch = f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
        self._pdl = pdl
        self.sharing = 1
        if mailbox is not None:
            if mailbox.tp != tp or mailbox.cap < self.cap or mailbox.words != self.width // 2:
                raise ValueError("the shared mailbox does not fit this gather")
            self.sharing = mailbox.sharing
        self._route = self._plan(ctas, threads, unroll)
        self.ctas = {m: c for m, (_, c) in self._route.items()}

    def kernel(self, threads=DEFAULT_THREADS, unroll=DEFAULT_UNROLL):
        """The compiled gather for these knobs (compiled once per process)."""
        from .kernels import compile_gather

        return compile_gather(self.tp, self.shard // 2, threads=threads, unroll=unroll,
                              pdl=self._pdl, arch=self._arch)

    def resident(self, threads=DEFAULT_THREADS, unroll=DEFAULT_UNROLL):
        """CTAs per rank that fit on the device alongside the ranks sharing it. With
        PDL a rank's next gather is launched early and holds SM slots beside its
        current one, which another virtual rank's current kernel may need: halved."""
        from .occupancy import resident_ctas

        k = self.kernel(threads, unroll)
        early = 2 if self._pdl and self.sharing > 1 else 1
        return resident_ctas(k.cubin, k.threads, self.device.index) // (self.sharing * early)

    def _plan(self, ctas, threads, unroll):
        """{rows: (launch, ctas)} from ``ctas``: None, an int, or a mapping of rows to
        an int or a RowPlan-like object (``ctas``, ``threads``, ``unroll``)."""
        if ctas is None:
            limit = self.resident(threads, unroll)
            ctas = {m: default_ctas(m, self.tp, self.shard, threads, unroll, limit)
                    for m in self.rows}
        elif isinstance(ctas, int):
            ctas = dict.fromkeys(self.rows, ctas)
        missing = self.rows - set(ctas)
        if missing:
            raise ValueError(f"no CTA count for rows {sorted(missing)}")
        route = {}
        for m in self.rows:
            c = ctas[m]
            t, u = getattr(c, "threads", threads), getattr(c, "unroll", unroll)
            c = int(getattr(c, "ctas", c))
            limit = self.resident(t, u)
            if not 1 <= c <= limit:
                raise ValueError(
                    f"{c} CTAs for {m} rows cannot all be co-resident: this device holds "
                    f"{limit} CTAs of {t} threads per rank ({self.sharing} rank(s) share it"
                    f"{', PDL on' if self._pdl else ''})")
            route[m] = (self.kernel(t, u).launch, c)
        return route

    def __call__(self, logits, stock):
        if self._flag.value:
            raise self._failure()
        shape = logits.shape
        if (len(shape) != 2 or shape[1] != self.shard or logits.dtype != torch.bfloat16):
            return stock(logits)
        route = self._route.get(shape[0])
        if (route is None or logits.get_device() != self._index or not logits.is_contiguous()
                or logits.data_ptr() % 16):
            return stock(logits)
        self._follow_stream()
        out = logits.new_empty((shape[0], self.width))  # under capture: the graph's own
        launch, ctas = route
        launch(logits, out.data_ptr(), self._peers, self.rank, ctas, self.budget_ns,
               self._status_address)
        self.parity ^= 1  # the host's view only; the kernel keeps the real alternation
        return out

    def _follow_stream(self):
        """Keep every call in one stream order: a call on a new stream waits first
        for the calls issued on the previous one."""
        now = (_raw_stream(self._index) if _raw_stream is not None
               else torch.cuda.current_stream(self.device).cuda_stream)
        if now != self._stream_id:
            current = torch.cuda.current_stream(self.device)
            # A capture may not wait on work outside it; its replays are ordered by the
            # stream the caller launches them on.
            if self._stream is not None and not torch.cuda.is_current_stream_capturing():
                current.wait_stream(self._stream)
            self._stream_id, self._stream = now, current

    def launch(self, logits, out, ctas):
        """The bare kernel launch into ``out`` on the current stream, with no checks:
        explicitly poisoned outputs in tests, CTA counts outside the plan in tuning."""
        launch = self._route[logits.shape[0]][0]
        launch(logits, out.data_ptr(), self._peers, self.rank, ctas, self.budget_ns,
               self._status_address)

    def _failure(self):
        record = self._status.tolist()
        missing = [r for r in range(self.tp) if record[STATUS_PEERS + r]]
        return GatherTimeout(self.rank, missing, record[STATUS_PARITY], record[STATUS_CAUSE])

    def check(self):
        """Raise ``GatherTimeout`` if any gather of this rank gave up (its own wait or
        a peer's mark, seen by its kernels so far)."""
        if self._flag.value:
            raise self._failure()

    def reset(self):
        """Collective: every rank (emulated: every virtual rank's gather) calls it.

        stop (the caller issues no gather) -> device sync (this rank's kernels, and
        so its late pushes, are done) -> barrier (every rank's are) -> arm the box and
        clear the mark and the status -> sync -> barrier (nobody pushes before every
        box is armed)."""
        torch.cuda.synchronize(self.device)
        self.box.barrier()
        self.box.arm()
        self._status.zero_()
        self.parity = 0  # arm() zeroed the epoch too
        torch.cuda.synchronize(self.device)
        self.box.barrier()

    def close(self):
        """Collective: release the mailbox once no peer can push into it."""
        self.box.close()
