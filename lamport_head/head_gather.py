"""HeadGather: the vocab-parallel lm_head's gather ``[M, V/TP] -> [M, V]`` (BF16) for a
set of row counts, on two parities of a Lamport mailbox.

Invariants a change must keep:

- Parity alternates per call, and every rank calls in the same order on one stream
  (the model runner's): two uses of a parity are then separated by a use of the
  other, so a rank pushes into a parity only after every peer finished reading and
  re-arming it. Calls under CUDA graph capture take ``stock`` (a replay would not
  advance the parity).
- Every shape the kernel does not serve takes ``stock``: rows not in ``rows``, not
  2-D, not BF16, the wrong width, another device, non-contiguous.
- Bytes move unchanged but for the sentinel word (+0, -0), which arrives as (+0, +0).
- A wait past the spin budget leaves a record in host-visible memory. The next call
  raises ``GatherTimeout`` naming the ranks that never published, once; afterwards
  the gather stays stock until ``reset()`` (collective) re-arms the mailbox.

Construction allocates the mailbox (collective over ``group``), arms it and orders it
before any push; ``install_logits_gather`` additionally agrees on success across ranks.
"""

import ctypes
import math

import torch

from .kernels import STATUS_PARITY, STATUS_PEERS, STATUS_ROW, compile_gather
from .mailbox import LamportRows

BUDGET_S = 2.0  # default spin budget per call
FRAGMENT_BF16 = 8  # BF16 values in one 16-byte fragment


class GatherTimeout(RuntimeError):
    """A gather waited past its budget for fragments some peers never pushed."""

    def __init__(self, rank, peers, parity, row):
        self.rank, self.peers, self.parity, self.row = rank, tuple(peers), parity, row
        names = ", ".join(str(p) for p in self.peers) or "unknown"
        super().__init__(
            f"lamport-head gather on rank {rank} timed out: rank(s) {names} never "
            f"published (parity {parity}, row {row}); the gather stays stock until reset()")


def default_ctas(rows: int, tp: int, shard: int, threads: int, unroll: int, limit: int) -> int:
    """Enough CTAs that each thread polls about ``unroll`` fragments, within ``limit``."""
    fragments = rows * (tp - 1) * (shard // FRAGMENT_BF16)
    return max(1, min(limit, math.ceil(fragments / (threads * unroll))))


class HeadGather:
    """``gather(logits, stock)``: the Lamport gather for ``rows``; ``stock`` otherwise.

    ``ctas``: None (a heuristic), an int for every row count, or ``{rows: ctas}``.
    ``mailbox``: a ``LocalRows`` shared by virtual ranks (one-GPU emulation); None
    allocates a ``LamportRows`` over ``group``."""

    def __init__(self, group, device, tp, rank, shard, rows, ctas=None, *, mailbox=None,
                 threads=256, unroll=4, pdl=True, budget_s=BUDGET_S):
        rows = frozenset(int(r) for r in rows)
        if not rows or min(rows) < 1:
            raise ValueError(f"rows must be a non-empty set of positive row counts, got {sorted(rows)}")
        if tp < 2 or not 0 <= rank < tp:
            raise ValueError(f"need tp >= 2 and 0 <= rank < tp, got tp={tp} rank={rank}")
        if shard <= 0 or shard % FRAGMENT_BF16:
            raise ValueError(f"shard width {shard} is not a positive multiple of {FRAGMENT_BF16}")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"HeadGather needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tp, self.rank, self.shard, self.width = tp, rank, shard, tp * shard
        self._index = self.device.index
        self.rows, self.cap = rows, max(rows)
        self.parity = 0
        self.group = group  # None: the default group (real ranks) or no group (emulated)
        major, minor = torch.cuda.get_device_capability(self.device)
        self._arch = f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
        self._pdl = pdl
        words = self.width // 2
        if mailbox is None:
            mailbox = LamportRows(group, self.device, tp, self.cap, words)
        elif mailbox.tp != tp or mailbox.cap < self.cap or mailbox.words != words:
            raise ValueError("the shared mailbox does not fit this gather")
        self.box = mailbox
        self._peers = mailbox.peers.data_ptr()  # the kernel reads the table by address
        self.sharing = tp if getattr(mailbox, "emulated", False) else 1
        self._route = self._plan(ctas, threads, unroll)
        self.ctas = {m: c for m, (_, c) in self._route.items()}
        self.budget_ns = int(budget_s * 1e9)
        # Host-visible error record (pinned: the kernel writes it, the host reads it
        # with no device sync): [flag, parity, row, one word per peer].
        self._status = torch.zeros(STATUS_PEERS + tp, dtype=torch.int32, pin_memory=True)
        self._status_address = self._status.data_ptr()
        self._flag = ctypes.c_int32.from_address(self._status_address)
        self.failed = None

    def kernel(self, threads=256, unroll=4):
        """The compiled gather for these knobs (compiled once per process)."""
        return compile_gather(self.tp, self.shard // 2, threads=threads, unroll=unroll,
                              pdl=self._pdl, arch=self._arch)

    def resident(self, threads=256, unroll=4):
        """CTAs per rank that fit on the device alongside the ranks sharing it."""
        from .occupancy import resident_ctas

        k = self.kernel(threads, unroll)
        return resident_ctas(k.cubin, k.threads, self.device.index) // self.sharing

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
                    f"{limit} CTAs of {t} threads per rank ({self.sharing} rank(s) share it)")
            route[m] = (self.kernel(t, u).launch, c)
        return route

    def __call__(self, logits, stock):
        if self._flag.value:
            return self._expired(logits, stock)
        shape = logits.shape
        if (len(shape) != 2 or shape[1] != self.shard or logits.dtype != torch.bfloat16):
            return stock(logits)
        route = self._route.get(shape[0])
        if (route is None or logits.get_device() != self._index or not logits.is_contiguous()
                or torch.cuda.is_current_stream_capturing()):
            return stock(logits)
        parity = self.parity
        self.parity = parity ^ 1
        out = logits.new_empty((shape[0], self.width))
        launch, ctas = route
        launch(logits, out.data_ptr(), self._peers, parity, self.rank, ctas, self.budget_ns,
               self._status_address)
        return out

    def launch(self, logits, out, parity, ctas):
        """The bare kernel launch on the current stream, with no checks and no parity
        bookkeeping: for graph capture in the benchmark (the caller alternates)."""
        launch = self._route[logits.shape[0]][0]
        launch(logits, out.data_ptr(), self._peers, parity, self.rank, ctas, self.budget_ns,
               self._status_address)

    def _expired(self, logits, stock):
        if self.failed is None:
            self.failed = self._timeout()
            raise self.failed
        return stock(logits)

    def _timeout(self):
        record = self._status.tolist()
        missing = [r for r in range(self.tp) if record[STATUS_PEERS + r]]
        return GatherTimeout(self.rank, missing, record[STATUS_PARITY], record[STATUS_ROW])

    def check(self):
        """Raise ``GatherTimeout`` if any call of this gather has timed out."""
        if self._flag.value:
            if self.failed is None:
                self.failed = self._timeout()
            raise self.failed

    def reset(self):
        """Re-arm after a timeout; collective: every rank (or, emulated, every virtual
        rank's gather, then the shared box once) calls it in the same order."""
        torch.cuda.synchronize(self.device)
        self.box.arm()
        self._status.zero_()
        self.failed = None
        self.parity = 0
        torch.cuda.synchronize(self.device)
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)
