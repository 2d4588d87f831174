"""The gather inside CUDA graphs, emulated ranks on one GPU: each virtual rank
captures its own graph of K gathers on its own stream; the graphs are replayed
concurrently with fresh data copied into the static inputs before each replay,
eager calls interleaved, bitwise every replay on every rank. A rank missing from a
replay makes every rank raise."""

import pytest
import torch
from helpers import no_stock

from lamport_head.tuning.support.emulate import EmulatedGather
from lamport_head.plan import uniform
from lamport_head.status import GatherTimeout
from lamport_head.tuning.support.reference import planted, reference_gather

pytestmark = pytest.mark.gpu

MS = (1, 8, 64)  # the K = 3 gathers each graph holds
NO_STOCK = no_stock("a served row count took stock under capture")


def _graph_ctas(device, tp, shard):
    """A quarter of the default co-residency limit: virtual ranks share one GPU, and
    inside a graph more of a rank's PDL-chained gathers may be resident at once than
    in a stream (on real ranks, one per GPU, only each kernel's own CTAs must fit)."""
    probe = EmulatedGather.default(device, tp, shard, (1,))
    return max(1, probe.ranks[0].resident() // 4)


def _prime_graphs(device):
    """Capture and replay a trivial graph once: the first graph launch of a process
    sets up once, which must not happen while a virtual rank's gather spins."""
    x = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize(device)


def _capture(gather, shard):
    """Per rank: static inputs, a graph of one gather per M in MS, its outputs."""
    device = gather.device
    _prime_graphs(device)
    data = planted(gather.tp, MS[0], shard, device=device)  # an eager step first, as
    gather([data[r] for r in range(gather.tp)])  # engines warm up before they capture
    # ... and every torch kernel a replay loop uses, once: CUDA loads a kernel lazily on
    # its first launch, and that load waits for the GPU to go idle. Between two virtual
    # ranks' replays a gather is spinning, so a first load would wait for it, and it for
    # the rank the host has not launched yet (real ranks: one GPU each, no such wait).
    scratch = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    words = data[0].view(torch.int32)
    scratch[0, 0, 0] = (words != words).any()
    data[0].clone().copy_(data[1])
    torch.cuda.synchronize(device)
    statics, graphs, outs = [], [], []
    for r, (g, stream) in enumerate(zip(gather.ranks, gather.streams)):
        static = [torch.zeros(m, shard, dtype=torch.bfloat16, device=device) for m in MS]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = [g(x, NO_STOCK) for x in static]
        statics.append(static)
        graphs.append(graph)
        outs.append(out)
    torch.cuda.synchronize(device)
    return statics, graphs, outs


def _replay(gather, statics, graphs, outs, shard, bad, i, skip=()):
    """One replay on every rank's stream (no join): fresh data in, compared on the
    rank's stream into ``bad[i, rank, k]``."""
    here = torch.cuda.current_stream(gather.device)
    data = [planted(gather.tp, m, shard, device=gather.device) for m in MS]
    want = [reference_gather(list(d)).view(torch.int32) for d in data]
    for r, stream in enumerate(gather.streams):
        if r in skip:
            continue
        stream.wait_stream(here)
        with torch.cuda.stream(stream):
            for k, d in enumerate(data):
                statics[r][k].copy_(d[r])
            graphs[r].replay()
            for k in range(len(MS)):
                bad[i, r, k] = (outs[r][k].view(torch.int32) != want[k]).any()
        for t in (*data, *want):
            t.record_stream(stream)


def _eager(gather, shard, bad, i):
    data = planted(gather.tp, 8, shard, device=gather.device)
    shards = [data[r] for r in range(gather.tp)]
    want = reference_gather(shards).view(torch.int32)
    here = torch.cuda.current_stream(gather.device)
    for r, (g, stream) in enumerate(zip(gather.ranks, gather.streams)):
        stream.wait_stream(here)
        with torch.cuda.stream(stream):
            bad[i, r, 0] = (g(shards[r], NO_STOCK).view(torch.int32) != want).any()
        for t in (data, want):
            t.record_stream(stream)


@pytest.mark.parametrize("tp", [2, 8])
def test_replays_concurrent_bitwise_with_eager_calls_between(tp):
    device = torch.device("cuda", torch.cuda.current_device())
    shard = 163840 // tp
    gather = EmulatedGather(device, tp, shard, uniform(MS, _graph_ctas(device, tp, shard)))
    statics, graphs, outs = _capture(gather, shard)
    replays = 1000
    bad = torch.zeros(replays, tp, len(MS), dtype=torch.int32, device=device)
    eager_bad = torch.zeros(replays // 10, tp, 1, dtype=torch.int32, device=device)
    for i in range(replays):
        _replay(gather, statics, graphs, outs, shard, bad, i)
        if i % 10 == 9:  # an eager call on every rank between two replays
            _eager(gather, shard, eager_bad, i // 10)
    for stream in gather.streams:
        torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    gather.check()
    wrong = bad.sum(dim=(1, 2)).nonzero().flatten().tolist()
    assert not wrong, f"replays {wrong[:10]} differ from the reference"
    assert not eager_bad.any(), "an eager call between replays differs"
    assert gather.armed()


def test_a_rank_missing_from_a_replay_makes_every_rank_raise():
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 4, 163840 // 4
    gather = EmulatedGather.default(device, tp, shard, MS, budget_s=0.3)
    statics, graphs, outs = _capture(gather, shard)
    bad = torch.zeros(2, tp, len(MS), dtype=torch.int32, device=device)
    _replay(gather, statics, graphs, outs, shard, bad, 0)
    _replay(gather, statics, graphs, outs, shard, bad, 1, skip=(2,))
    torch.cuda.synchronize(device)
    assert not bad[0].any()
    for g in gather.ranks:  # every rank's mailbox carries the mark, the absent one's too
        with pytest.raises(GatherTimeout, match=r"rank\(s\) 2 never published"):
            g.check()
    # the next replay fails on every rank (it begins marked) and raises every flag
    _replay(gather, statics, graphs, outs, shard, bad, 1)
    torch.cuda.synchronize(device)
    x = planted(8, shard, device=device)
    for g in gather.ranks:
        with pytest.raises(GatherTimeout, match=r"rank\(s\) 2 never published"):
            g(x, NO_STOCK)
    gather.reset()
    bad.zero_()
    _replay(gather, statics, graphs, outs, shard, bad, 0)
    torch.cuda.synchronize(device)
    assert not bad.any()
    assert gather.armed()
