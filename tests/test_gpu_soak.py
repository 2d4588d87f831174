"""Long-run reliability on one GPU: an emulated TP-8 soak, M random among the served
rows every call, checksummed every call and compared in full every 100th; mailbox
armed at the end; no growth in GPU or host memory. LAMPORT_HEAD_SOAK sets the call
count (default 100,000)."""

import os
import random
import resource

import pytest
import torch
from helpers import assert_same_words

from lamport_head.tuning.support.emulate import EmulatedGather
from lamport_head.tuning.support.reference import planted, reference_gather

pytestmark = pytest.mark.gpu

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def test_soak_emulated_tp8():
    calls = int(os.environ.get("LAMPORT_HEAD_SOAK", "100000"))
    device = torch.device("cuda", torch.cuda.current_device())
    tp, vocab = 8, 163840
    shard = vocab // tp
    gather = EmulatedGather.default(device, tp, shard, ROWS)
    pool = [planted(tp, max(ROWS), shard, device=device) for _ in range(8)]
    gen = torch.Generator(device=device).manual_seed(1)
    weights = torch.randint(1, 1 << 20, (max(ROWS), vocab // 2), generator=gen, device=device,
                            dtype=torch.int64)
    want = {}

    def checksum(words):  # [..., M, V/2] int32 -> position-weighted sums
        m = words.shape[-2]
        return (words.to(torch.int64) * weights[:m]).sum(dim=(-1, -2))

    for k in range(len(pool)):  # every expected checksum up front: no allocation later
        for rows in ROWS:
            want[(k, rows)] = checksum(reference_gather([pool[k][r, :rows] for r in range(tp)])
                                       .view(torch.int32))
    bad = torch.zeros((), dtype=torch.int64, device=device)
    rng = random.Random(7)
    baseline_gpu = baseline_rss = None
    for call in range(calls):
        rows, k = rng.choice(ROWS), rng.randrange(len(pool))
        shards = [pool[k][r, :rows] for r in range(tp)]
        outs = gather(shards)
        sums = checksum(torch.stack([o.view(torch.int32) for o in outs]))
        bad += (sums != want[(k, rows)]).sum()
        if call % 100 == 0:
            ref = reference_gather(shards).view(torch.int32)
            for r, o in enumerate(outs):
                assert_same_words(o, ref, f"call {call} rank {r} M={rows}")
            assert bad.item() == 0, f"checksum mismatch by call {call}"
        if call == 1000:
            del outs, sums
            torch.cuda.synchronize(device)
            baseline_gpu = torch.cuda.memory_allocated(device)
            baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.cuda.synchronize(device)
    assert bad.item() == 0
    gather.check()
    assert gather.armed()
    if baseline_gpu is not None:
        outs = sums = ref = None  # the test's own last tensors (ref: up to M*V*2 bytes)
        torch.cuda.synchronize(device)
        grown_gpu = torch.cuda.memory_allocated(device) - baseline_gpu
        grown_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_rss
        print(f"\nsoak: {calls} calls, GPU allocated growth {grown_gpu} B, peak RSS growth {grown_rss} KiB")
        assert grown_gpu <= 0
        assert grown_rss < 64 * 1024
