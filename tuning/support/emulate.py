"""TP virtual ranks of HeadGather on one GPU, for tests, tuning and benchmarks.

Each virtual rank launches on its own stream (forked from and joined back into the
caller's current stream), so the ranks' kernels run concurrently as real ranks
would; they share one ``LocalMailbox`` peer table. All CTAs of all ranks must fit on
the device at once (a rank's CTAs wait for the others' pushes): construction checks
that and raises a clear error otherwise.

``EmulatedAllToAll``: the same for the all-to-all of vocab shards (``AllToAll``), each
row count M split over the ranks one way, fixed at construction.
"""

import time

import torch

from lamport_head.all_to_all import AllToAll, even_splits
from lamport_head.dtypes import words
from lamport_head.head_gather import HeadGather
from lamport_head.mailbox_collective import Setup
from lamport_head.settings import SPIN_BUDGET_S
from lamport_head.status import RECOVERABLE
from lamport_head.kernels.protocol import DEFAULT_THREADS
from lamport_head.mailbox import LocalMailbox


class EmulatedGather:
    """``gather(shards) -> outs``: one emulated step of ``tp`` ranks on ``device``.
    ``plan``: ``{rows: GatherConfig}`` as ``HeadGather`` takes it;
    ``EmulatedGather.default`` builds on the built-in heuristic's plan."""

    _collective = HeadGather  # each virtual rank's class

    def __init__(self, device, tp, shard, plan, *, pdl=None, budget_s=SPIN_BUDGET_S,
                 dtype=torch.bfloat16):
        """``dtype``: the logits' dtype every virtual rank serves."""
        self._build(device, tp, shard, max(plan), dtype, lambda box, r: self._collective(
            None, self.device, tp, r, shard, plan, mode=RECOVERABLE, dtype=dtype,
            setup=Setup(mailbox=box, pdl=pdl, budget_s=budget_s)))

    @classmethod
    def default(cls, device, tp, shard, rows, *, threads=DEFAULT_THREADS, unroll=None, pdl=None,
                budget_s=SPIN_BUDGET_S, dtype=torch.bfloat16):
        """The emulated gather of the row counts ``rows`` on the heuristic's plan."""
        emu = cls.__new__(cls)
        emu._build(device, tp, shard, max(rows), dtype, lambda box, r: cls._collective.default(
            None, emu.device, tp, r, shard, rows, mode=RECOVERABLE, dtype=dtype,
            setup=Setup(mailbox=box, pdl=pdl, budget_s=budget_s, threads=threads,
                        unroll=unroll)))
        return emu

    def _build(self, device, tp, shard, cap, dtype, rank_gather):
        self.device = torch.device(device)
        self.tp, self.shard_width, self.dtype = tp, shard, dtype
        self.box = LocalMailbox(self.device, tp, cap, tp * words(shard, dtype))
        self.ranks = [rank_gather(self.box, r) for r in range(tp)]
        self.streams = [torch.cuda.Stream(self.device) for _ in range(tp)]
        self.plan = self.ranks[0].plan
        self.host_s = 0.0  # host seconds spent inside the ranks' HeadGather calls

    @property
    def rows(self):
        return self.ranks[0].rows

    def call(self, r, shard, stock):
        """Rank ``r``'s call on ``shard``, on the current stream. ``stock``: the stand-in
        of the engine's all-gather, ``[M, V/TP] -> [M, V]``."""
        return self.ranks[r](shard, *self._args(r, shard, stock))

    def _args(self, r, shard, stock):
        """What rank ``r``'s call takes after ``shard`` (worked out before a timed call)."""
        return (stock,)

    def _launch(self, r, shard, out, ctas):
        """Rank ``r``'s bare launch into ``out``, on the current stream."""
        self.ranks[r].launch(shard, out, ctas)

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
                args = self._args(r, shards[r], stock)
                t0 = time.perf_counter()
                outs.append(gather(shards[r], *args))
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
            for r, stream in enumerate(self.streams):
                with torch.cuda.stream(stream):
                    row.append(self.call(r, shards[r], stock))
            outs.append(row)
        for stream in self.streams:
            here.wait_stream(stream)
        return outs

    def launch(self, shards, outs, ctas):
        """Bare launches of every rank into ``outs``: no checks."""
        here = torch.cuda.current_stream(self.device)
        for r, (stream, shard, out) in enumerate(zip(self.streams, shards, outs)):
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                self._launch(r, shard, out, ctas)
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


class EmulatedAllToAll(EmulatedGather):
    """``EmulatedGather`` of the all-to-all: TP virtual ranks of ``AllToAll``; a call of
    M rows splits them ``splits[M]`` on every rank (an M not in ``splits``: evenly,
    ``even_splits``), so rank q's output is its ``[splits[M][q], V]``. Every method
    takes and returns what ``EmulatedGather``'s does, per rank."""

    _collective = AllToAll
    _splits = {}  # {M: splits}, never mutated; ``default`` builds with none: every M even

    def __init__(self, device, tp, shard, plan, *, splits=None, **options):
        """``splits``: ``{M: [rows of rank 0, ..., rows of rank tp - 1]}``, summing to M;
        the rest as ``EmulatedGather``."""
        self._splits = {m: list(s) for m, s in (splits or {}).items()}
        super().__init__(device, tp, shard, plan, **options)

    def splits_of(self, rows):
        """How a call of ``rows`` rows splits over the ranks."""
        return self._splits.get(rows) or even_splits(rows, self.tp)

    def _args(self, r, shard, stock):
        """The splits of ``shard``'s rows, rank ``r``'s rows and the all-to-all's stock:
        rank r's rows of what ``stock`` (the all-gather's stand-in) returns."""
        splits = self.splits_of(shard.shape[0])
        first = sum(splits[:r])
        return splits, splits[r], lambda x, s, n: stock(x)[first:first + splits[r]]

    def _launch(self, r, shard, out, ctas):
        self.ranks[r].launch(shard, out, ctas, self.splits_of(shard.shape[0]))


class _Stock:
    """The one-GPU stand-in for the stock all-gather: a cat of every rank's shard."""

    def __init__(self, shards):
        self.shards = shards

    def __call__(self, logits):
        return torch.cat(self.shards, dim=1)

