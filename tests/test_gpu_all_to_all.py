"""The kernel's all-to-all mode on one GPU with TP virtual ranks: bitwise against
``reference_all_to_all`` (issue 43 item 1).

``_Ranks`` is the host plumbing a test needs, kept here: one ``LocalMailbox`` shared
by the ranks, one stream and one pinned status record per rank, the compiled kernel
(``compile_all_to_all``) launched per rank through the driver (``DriverLaunch``) with
that call's row offsets. Every rank launches on every call, its output of 0 rows
included: the parity moves on every rank every call, and a rank of 0 rows waits on a
token from every peer (``steps.push_token``), so ranks free-run on the mailbox alone
(none more than a call ahead). Outputs are poisoned first.
"""

import random

import pytest
import torch
from helpers import words

from lamport_head.kernels.protocol import (CONTROL_EPOCH, CONTROL_MARK, CONTROL_MISSING,
                                           NAN_PAIR, STATUS_FLAG, STATUS_WORDS)
from lamport_head.tuning.support.reference import offsets_of, planted, reference_all_to_all

pytestmark = pytest.mark.gpu

POISON = 0x7FBF7FBF  # a NaN pair the kernel never writes on its own (not NAN_PAIR)
VOCAB = 32768  # small rows: hundreds of calls in seconds (the full width: one test)


class _Ranks:
    """``tp`` virtual ranks of the all-to-all on ``device``, ``cap`` rows a box.
    ``launch(s, shards, splits, outs)`` issues call ``s`` of every rank (``skip``:
    ranks not launched), each on its own stream, with no join: the caller orders the
    streams (``start``, ``join``)."""

    def __init__(self, device, tp, shard, cap, *, threads=256, unroll=4, ctas=4,
                 budget_s=2.0):
        from lamport_head.kernels import compile_all_to_all
        from lamport_head.launch import DriverLaunch
        from lamport_head.kernels.arch import target
        from lamport_head.launch import bind_primary_context
        from lamport_head.mailbox import LocalMailbox

        self.device, self.tp, self.shard_width, self.ctas = device, tp, shard, ctas
        bind_primary_context(device.index)
        self.box = LocalMailbox(device, tp, cap, tp * shard // 2)
        arch = target(*torch.cuda.get_device_capability(device))
        self.compiled = compile_all_to_all(tp, shard // 2, threads=threads, unroll=unroll,
                                           arch=arch)
        self.launchers = [DriverLaunch(self.compiled, serving=False) for _ in range(tp)]
        self.status = [torch.zeros(STATUS_WORDS, dtype=torch.int32, pin_memory=True)
                       for _ in range(tp)]
        self.streams = [torch.cuda.Stream(device) for _ in range(tp)]
        self.budget = int(budget_s * 1e9)

    def outputs(self, splits):
        """Poisoned outputs, ``[splits[q], V]`` for rank q."""
        return [torch.full((n, self.tp * self.shard_width // 2), POISON, dtype=torch.int32,
                           device=self.device).view(torch.bfloat16) for n in splits]

    def start(self):
        here = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            stream.wait_stream(here)

    def join(self):
        here = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            here.wait_stream(stream)

    def launch(self, shards, splits, outs, skip=()):
        offsets = offsets_of(splits)
        peers = self.box.peers.data_ptr()
        for r in range(self.tp):
            if r in skip:
                continue
            self.launchers[r](shards[r], outs[r].data_ptr(), peers, r, self.ctas, self.budget,
                              self.status[r].data_ptr(), self.streams[r].cuda_stream, offsets)

    def __call__(self, shards, splits, skip=()):
        """One joined call of every rank: the poisoned outputs, filled."""
        outs = self.outputs(splits)
        self.start()
        self.launch(shards, splits, outs, skip)
        self.join()
        return outs

    def epochs(self):
        torch.cuda.synchronize(self.device)
        return [int(self.box.control(r)[CONTROL_EPOCH]) for r in range(self.tp)]

    def flags(self):
        torch.cuda.synchronize(self.device)
        return [int(s[STATUS_FLAG]) for s in self.status]


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _shards(tp, rows, shard, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    data = planted(tp, rows, shard, generator=g, device=device)
    return [data[r] for r in range(tp)]


def _check(outs, shards, splits, what):
    want = reference_all_to_all(shards, splits)
    for q, (out, w) in enumerate(zip(outs, want)):
        assert out.shape == w.shape, f"{what}, rank {q}"
        if not torch.equal(words(out), words(w)):
            bad = (words(out) != words(w)).nonzero()
            raise AssertionError(f"{what}, rank {q}: {bad.shape[0]} words differ, first at "
                                 f"{bad[0].tolist()} (got {int(words(out)[tuple(bad[0])]):#x}, "
                                 f"want {int(words(w)[tuple(bad[0])]):#x})")


def _free_run(ranks, plan, device, lag_every=None):
    """Every call of ``plan`` (``[(splits, shards)]``) on every rank, outputs poisoned
    before the start, no join between calls; rank 0's stream sleeps before every
    ``lag_every``-th call (it lags). Then: every output bitwise, every epoch the call
    count, no flag, every mailbox word (tokens included) re-armed."""
    outs = [ranks.outputs(splits) for splits, _ in plan]  # poisoned, before the start
    ranks.start()
    for call, ((splits, shards), out) in enumerate(zip(plan, outs)):
        if lag_every and call % lag_every == 3:
            with torch.cuda.stream(ranks.streams[0]):
                torch.cuda._sleep(50_000)
        ranks.launch(shards, splits, out)
    ranks.join()
    torch.cuda.synchronize(device)
    for call, ((splits, shards), out) in enumerate(zip(plan, outs)):
        _check(out, shards, splits, f"call {call}, splits {splits}")
    assert ranks.epochs() == [len(plan)] * ranks.tp
    assert ranks.flags() == [0] * ranks.tp
    assert ranks.box.armed(), "mailbox words left un-armed after the free run"


def _random_splits(rng, tp, cap, empty):
    """Splits of up to ``cap`` rows a rank; ``empty``: some ranks empty, sometimes
    every one."""
    kind = rng.random()
    if empty and kind < 0.1:
        return (0,) * tp
    if kind < 0.3:
        n = rng.randint(1, cap)
        return (n,) * tp  # even
    low = 0 if empty else 1
    return tuple(low if rng.random() < 0.3 else rng.randint(1, cap) for _ in range(tp))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_even_uneven_and_empty_splits_are_bitwise(tp):
    """Joined calls, each split shape once: even, uneven, one rank empty, every rank
    empty, all rows to one rank, every call joined (all ranks finish it first)."""
    device = _device()
    cap = 16
    ranks = _Ranks(device, tp, VOCAB // tp, cap)
    cases = [(4,) * tp, tuple(range(1, tp + 1)), (0,) + (3,) * (tp - 1), (0,) * tp,
             (cap,) + (0,) * (tp - 1), (0,) * (tp - 1) + (1,), (1,) * tp,
             tuple(cap if q % 2 else 0 for q in range(tp))]
    for call, splits in enumerate(cases):
        shards = _shards(tp, sum(splits), VOCAB // tp, device, seed=call)
        _check(ranks(shards, splits), shards, splits, f"call {call}, splits {splits}")
    assert ranks.epochs() == [len(cases)] * tp  # every rank advanced every call
    assert ranks.flags() == [0] * tp
    assert ranks.box.armed(), "mailbox words left un-armed"


@pytest.mark.parametrize("empty", [False, True], ids=["no-empty-rank", "empty-ranks"])
@pytest.mark.parametrize("tp", [2, 8])
def test_free_running_ranks_with_splits_changing_every_call(tp, empty):
    """300 calls per rank, each rank on its own stream with no join between calls
    (the mailbox alone orders them: a rank may be a call ahead), the splits new every
    call (``empty``: some ranks empty, sometimes all); every output bitwise, every
    epoch 300, every mailbox word re-armed, no flag."""
    device = _device()
    calls, cap, shard = 300, 12, VOCAB // tp
    ranks = _Ranks(device, tp, shard, cap, budget_s=0.5)
    rng = random.Random(tp)
    plan, previous = [], None
    for call in range(calls):
        splits = _random_splits(rng, tp, cap, empty)
        while splits == previous:
            splits = _random_splits(rng, tp, cap, empty)
        previous = splits
        plan.append((splits, _shards(tp, sum(splits), shard, device, seed=1000 + call)))
    _free_run(ranks, plan, device)


@pytest.mark.parametrize("unroll", [4, 8])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_rank_empty_on_most_calls_runs_free_with_the_others(tp, unroll):
    """The zero-row race (fixed by the token): rank tp - 1 has 0 rows on nine calls in
    ten, so its calls are short and it runs ahead as far as the mailbox lets it, while
    rank 0's stream sleeps before some calls (it lags). Without the token that rank's
    call s + 1 pushed into rank 0's box of the parity rank 0 was still re-arming in call
    s - 1 (wrong words, or a timeout). 300 free-running calls: every output bitwise,
    every epoch 300, every mailbox word re-armed, no flag. Unroll 8: the staged poll."""
    device = _device()
    calls, cap, shard = 300, 8, VOCAB // tp
    ranks = _Ranks(device, tp, shard, cap, unroll=unroll, budget_s=0.5)
    rng = random.Random(100 + tp)
    plan = []
    for call in range(calls):
        splits = [rng.randint(1, cap) for _ in range(tp - 1)]
        splits.append(0 if rng.random() < 0.9 else rng.randint(1, cap))
        if rng.random() < 0.05:
            splits = [0] * tp  # every rank polls only tokens
        splits = tuple(splits)
        plan.append((splits, _shards(tp, sum(splits), shard, device, seed=2000 + call)))
    _free_run(ranks, plan, device, lag_every=7)


def test_full_vocab_staged_and_one_fragment_rows():
    """The full-width shard (V = 163840) staged (unroll 8), and rows of one fragment a
    rank (8 BF16: the candidate width), TP 8, uneven splits with empty ranks."""
    device = _device()
    for shard, unroll in ((163840 // 8, 8), (8, 4)):
        ranks = _Ranks(device, 8, shard, 8, unroll=unroll)
        for call, splits in enumerate([(1, 0, 2, 8, 0, 0, 3, 1), (8,) * 8, (0,) * 8,
                                       (0, 0, 0, 0, 0, 0, 0, 5)]):
            shards = _shards(8, sum(splits), shard, device, seed=call)
            _check(ranks(shards, splits), shards, splits, f"shard {shard}, call {call}")
        assert ranks.box.armed()


def test_the_dsl_callable_and_the_driver_launch_agree():
    """The compiled kernel's own TVM-FFI callable (``CompiledGather.launch``: the
    gather's arguments, then the ``MAX_TP + 1`` offsets) and ``DriverLaunch`` in
    alternate calls: the same words, one parity sequence."""
    from lamport_head.kernels.protocol import MAX_TP

    device = _device()
    tp, cap = 4, 8
    ranks = _Ranks(device, tp, VOCAB // tp, cap)
    here = torch.cuda.current_stream(device)
    for call, splits in enumerate([(1, 2, 0, 5), (8, 8, 8, 8), (0, 0, 0, 0), (3, 0, 0, 1)] * 2):
        shards = _shards(tp, sum(splits), VOCAB // tp, device, seed=call)
        if call % 2:
            outs = ranks(shards, splits)
        else:
            outs = ranks.outputs(splits)
            offsets = offsets_of(splits)
            offsets = tuple(offsets) + (offsets[-1],) * (MAX_TP + 1 - len(offsets))
            peers = ranks.box.peers.data_ptr()
            ranks.start()
            for r in range(tp):  # the env stream: torch's current one (no stream argument)
                with torch.cuda.stream(ranks.streams[r]):
                    ranks.compiled.launch(shards[r], outs[r].data_ptr(), peers, r, ranks.ctas,
                                          ranks.budget, ranks.status[r].data_ptr(), 0, offsets)
            ranks.join()
            here.synchronize()
        _check(outs, shards, splits, f"call {call} ({'driver' if call % 2 else 'dsl'})")
    assert ranks.box.armed()


def test_a_rank_that_never_launches_is_found_missing_and_its_columns_are_nan():
    """Recoverable give-up, as the gather's: rank 1 skips one call; every rank that
    polls rows writes NaN in rank 1's columns (the rest bitwise), marks every rank
    and records rank 1 missing; a rank of 0 rows waits on rank 1's token as on data,
    gives up alike and writes nothing (its output has no row)."""
    device = _device()
    tp, shard = 4, VOCAB // 4
    ranks = _Ranks(device, tp, shard, 8, budget_s=0.05)
    splits = (2, 3, 0, 1)
    shards = _shards(tp, sum(splits), shard, device, seed=5)
    outs = ranks(shards, splits, skip=(1,))
    torch.cuda.synchronize(device)
    want = reference_all_to_all(shards, splits)
    cols = slice(shard // 2, 2 * shard // 2)  # rank 1's words
    for q in (0, 3):
        got, w = words(outs[q]).clone(), words(want[q]).clone()
        assert (got[:, cols] == NAN_PAIR).all(), f"rank {q}: rank 1's columns not NaN"
        got[:, cols] = w[:, cols] = 0
        assert torch.equal(got, w), f"rank {q}: the arrived columns differ"
    assert outs[2].shape[0] == 0
    for q in (0, 2, 3):
        control = ranks.box.control(q)
        assert int(control[CONTROL_MARK]) != 0, f"rank {q} not marked"
        assert int(control[CONTROL_MISSING + 1]) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tp", [2, 8])
def test_the_host_all_to_all_serves_its_plan_and_free_runs(tp, dtype):
    """``AllToAll`` (the host's object, as install builds it, over one ``LocalMailbox``
    shared by ``tp`` virtual ranks, each called on its own stream, no join between
    calls): 120 calls with splits new every call (empty ranks included), every output
    bitwise against the reference; an M outside the plan takes the stock on every rank;
    the mailbox re-armed at the end."""
    from lamport_head.all_to_all import AllToAll
    from lamport_head.mailbox_collective import Setup
    from lamport_head.config import GatherConfig
    from lamport_head.dtypes import words as words_of
    from lamport_head.mailbox import LocalMailbox

    device = _device()
    shard, rows = VOCAB // tp, (1, 2, 5, 8, 12)
    box = LocalMailbox(device, tp, max(rows), tp * words_of(shard, dtype))
    plan = {m: GatherConfig(4) for m in rows}
    ranks = [AllToAll(None, device, tp, r, shard, plan, mode="recoverable", dtype=dtype,
                      setup=Setup(mailbox=box, budget_s=0.5)) for r in range(tp)]
    streams = [torch.cuda.Stream(device) for _ in range(tp)]
    rng, log = random.Random(tp), []
    here = torch.cuda.current_stream(device)
    for stream in streams:
        stream.wait_stream(here)
    for call in range(120):
        m = rng.choice(rows + (3,))  # 3: not in the plan
        cuts = sorted(rng.randint(0, m) for _ in range(tp - 1))  # empty ranks included
        splits = tuple(b - a for a, b in zip([0] + cuts, cuts + [m]))
        total = m
        g = torch.Generator(device=device).manual_seed(3000 + call)
        data = planted(tp, total, shard, generator=g, device=device, dtype=dtype)
        shards = [data[r] for r in range(tp)]
        outs = []
        for r in range(tp):
            with torch.cuda.stream(streams[r]):
                outs.append(ranks[r](shards[r], list(splits), splits[r],
                                     lambda *a: "stock"))
        log.append((splits, shards, outs))
    for stream in streams:
        here.wait_stream(stream)
    torch.cuda.synchronize(device)
    for call, (splits, shards, outs) in enumerate(log):
        if sum(splits) not in rows:
            assert outs == ["stock"] * tp, f"call {call}: M={sum(splits)} served"
            continue
        _check(outs, shards, splits, f"call {call}, splits {splits}")
    assert box.armed()


def test_captured_calls_replay_between_eager_calls_of_other_splits():
    """DSpark's exchange runs inside vLLM's graphs, the target's sampling eagerly, on one
    AllToAll when their shard widths match: per virtual rank a graph of one call (M = 8,
    even splits: its offsets captured by value), replayed between eager calls of other
    M and splits (empty ranks included) on the same objects and streams, no join between
    calls; each replay's output copied out in stream order. Every output bitwise, every
    epoch the call count, the mailbox re-armed."""
    from lamport_head.all_to_all import AllToAll
    from lamport_head.mailbox_collective import Setup
    from lamport_head.config import GatherConfig
    from lamport_head.mailbox import LocalMailbox

    device = _device()
    tp, shard, rows = 4, VOCAB // 4, (1, 3, 8)
    box = LocalMailbox(device, tp, max(rows), tp * shard // 2)
    plan = {m: GatherConfig(4) for m in rows}
    ranks = [AllToAll(None, device, tp, r, shard, plan, mode="recoverable",
                      setup=Setup(mailbox=box, budget_s=0.5)) for r in range(tp)]
    streams = [torch.cuda.Stream(device) for _ in range(tp)]
    here = torch.cuda.current_stream(device)
    captured_splits = [2, 2, 2, 2]
    g = torch.Generator(device=device).manual_seed(77)
    static = planted(tp, 8, shard, generator=g, device=device)  # the graphs' inputs
    static = [static[r].clone() for r in range(tp)]
    graphs, static_out = [], []
    for r in range(tp):  # capture records, it does not run: no rank waits on another
        graph = torch.cuda.CUDAGraph()
        streams[r].wait_stream(here)
        with torch.cuda.graph(graph, stream=streams[r]):
            static_out.append(ranks[r](static[r], captured_splits, 2, None))
        graphs.append(graph)
    torch.cuda.synchronize(device)
    rng, log = random.Random(5), []
    for stream in streams:
        stream.wait_stream(here)
    for call in range(60):
        if call % 3 == 2:  # a replay: new data into the static inputs, then the graph
            g = torch.Generator(device=device).manual_seed(5000 + call)
            data = planted(tp, 8, shard, generator=g, device=device)
            outs = []
            for r in range(tp):
                with torch.cuda.stream(streams[r]):
                    static[r].copy_(data[r])
                    graphs[r].replay()
                    outs.append(static_out[r].clone())  # in stream order: before the next
            log.append((captured_splits, [data[r] for r in range(tp)], outs))
            continue
        m = rng.choice(rows)
        cuts = sorted(rng.randint(0, m) for _ in range(tp - 1))
        splits = [b - a for a, b in zip([0] + cuts, cuts + [m])]
        g = torch.Generator(device=device).manual_seed(6000 + call)
        data = planted(tp, m, shard, generator=g, device=device)
        outs = []
        for r in range(tp):
            with torch.cuda.stream(streams[r]):
                outs.append(ranks[r](data[r], splits, splits[r], None))
        log.append((splits, [data[r] for r in range(tp)], outs))
    for stream in streams:
        here.wait_stream(stream)
    torch.cuda.synchronize(device)
    for call, (splits, shards, outs) in enumerate(log):
        _check(outs, shards, splits, f"call {call} ({'replay' if call % 3 == 2 else 'eager'})")
    assert [int(box.control(r)[CONTROL_EPOCH]) for r in range(tp)] == [60] * tp
    assert box.armed()
