"""TP virtual ranks of HeadGather on one GPU, for tests, tuning and benchmarks.

Each virtual rank launches on its own stream (forked from and joined back into the
caller's current stream), so the ranks' kernels run concurrently as real ranks
would; they share one ``LocalMailbox`` peer table. All CTAs of all ranks must fit on
the device at once (a rank's CTAs wait for the others' pushes): construction checks
that and raises a clear error otherwise.
"""

import time

import torch

from lamport_head.dtypes import words
from lamport_head.head_gather import SPIN_BUDGET_S, HeadGather
from lamport_head.status import RECOVERABLE
from lamport_head.kernels.protocol import DEFAULT_THREADS
from lamport_head.mailbox import LocalMailbox


class EmulatedGather:
    """``gather(shards) -> outs``: one emulated step of ``tp`` ranks on ``device``.
    ``plan``: ``{rows: GatherConfig}`` as ``HeadGather`` takes it;
    ``EmulatedGather.default`` builds on the built-in heuristic's plan."""

    def __init__(self, device, tp, shard, plan, *, pdl=None, budget_s=SPIN_BUDGET_S,
                 dtype=torch.bfloat16):
        """``dtype``: the logits' dtype every virtual rank serves."""
        self._build(device, tp, shard, max(plan), dtype, lambda box, r: HeadGather(
            None, self.device, tp, r, shard, plan, mailbox=box, pdl=pdl, budget_s=budget_s,
            mode=RECOVERABLE, dtype=dtype))

    @classmethod
    def default(cls, device, tp, shard, rows, *, threads=DEFAULT_THREADS, unroll=None, pdl=None,
                budget_s=SPIN_BUDGET_S, dtype=torch.bfloat16):
        """The emulated gather of the row counts ``rows`` on the heuristic's plan."""
        emu = cls.__new__(cls)
        emu._build(device, tp, shard, max(rows), dtype, lambda box, r: HeadGather.default(
            None, emu.device, tp, r, shard, rows, threads=threads, unroll=unroll, mailbox=box,
            pdl=pdl, budget_s=budget_s, mode=RECOVERABLE, dtype=dtype))
        return emu

    def _build(self, device, tp, shard, cap, dtype, rank_gather):
        self.device = torch.device(device)
        self.tp, self.shard, self.dtype = tp, shard, dtype
        self.box = LocalMailbox(self.device, tp, cap, tp * words(shard, dtype))
        self.ranks = [rank_gather(self.box, r) for r in range(tp)]
        self.streams = [torch.cuda.Stream(self.device) for _ in range(tp)]
        self.plan = self.ranks[0].plan
        self.host_s = 0.0  # host seconds spent inside the ranks' HeadGather calls

    @property
    def rows(self):
        return self.ranks[0].rows

    def __call__(self, shards, *, skip=()):
        """Outputs of every virtual rank (``None`` for ranks in ``skip``, which are
        never launched: their peers wait and time out)."""
        if len(shards) != self.tp:
            raise ValueError(f"need {self.tp} shards, got {len(shards)}")
        here = torch.cuda.current_stream(self.device)
        stock = _Stock(shards)
        outs = []
        for r, (gather, stream) in enumerate(zip(self.ranks, self.streams)):
            if r in skip:
                outs.append(None)
                continue
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                t0 = time.perf_counter()
                outs.append(gather(shards[r], stock))
                self.host_s += time.perf_counter() - t0
        for r, stream in enumerate(self.streams):
            if r not in skip:
                here.wait_stream(stream)
        return outs

    def run_steps(self, shards, steps):
        """``steps`` calls per rank on the same shards; see ``free_run``. Returns the
        last step's outputs."""
        return self.free_run([shards] * steps)[-1]

    def free_run(self, steps, *, delay=None):
        """One call per rank per element of ``steps`` (each a list of ``tp`` shards),
        each rank on its own stream with no join between steps, as real ranks run:
        the mailbox alone orders them, so a rank may be whole calls ahead. Joined at
        the end. ``delay``: {rank: GPU cycles} that rank's stream sleeps before its
        first call (a slow rank). Returns the outputs, ``[step][rank]``."""
        here = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            stream.wait_stream(here)
        for r, cycles in (delay or {}).items():
            with torch.cuda.stream(self.streams[r]):
                torch.cuda._sleep(cycles)
        outs = []
        for shards in steps:
            stock = _Stock(shards)
            row = []
            for r, (gather, stream) in enumerate(zip(self.ranks, self.streams)):
                with torch.cuda.stream(stream):
                    row.append(gather(shards[r], stock))
            outs.append(row)
        for stream in self.streams:
            here.wait_stream(stream)
        return outs

    def launch(self, shards, outs, ctas):
        """Bare launches of every rank into ``outs``: no checks."""
        here = torch.cuda.current_stream(self.device)
        for gather, stream, shard, out in zip(self.ranks, self.streams, shards, outs):
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                gather.launch(shard, out, ctas)
        for stream in self.streams:
            here.wait_stream(stream)

    def check(self):
        for gather in self.ranks:
            gather.check()

    def reset(self):
        for gather in self.ranks:
            gather.reset()

    def armed(self) -> bool:
        """True when every mailbox word is armed and no mark is set (synchronizes)."""
        torch.cuda.synchronize(self.device)
        return self.box.armed()


class _Stock:
    """The one-GPU stand-in for the stock all-gather: a cat of every rank's shard."""

    def __init__(self, shards):
        self.shards = shards

    def __call__(self, logits):
        return torch.cat(self.shards, dim=1)

