"""HeadGather on one GPU with emulated TP ranks: bitwise against the reference."""

import random
import time

import pytest
import torch

from lamport_head.emulate import EmulatedGather
from lamport_head.head_gather import GatherTimeout
from lamport_head.reference import planted, reference_gather

pytestmark = pytest.mark.gpu

ROWS = (1, 2, 3, 7, 8, 16, 33, 64)
POISON = 0x7FBF7FBF  # a NaN pair the kernel never writes on its own


def _poison_allocator(rows, width, device):
    """Leave freed blocks full of POISON where the next outputs will be allocated."""
    blocks = [torch.full((rows, width // 2), POISON, dtype=torch.int32, device=device)
              for _ in range(4)]
    del blocks


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _shards(tp, rows, shard, device):
    data = planted(tp, rows, shard, device=device)
    return [data[r] for r in range(tp)]


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("vocab", [163840, 151936, 129280])
def test_emulated_bitwise_2000_calls(tp, vocab):
    device = torch.device("cuda", torch.cuda.current_device())
    shard = vocab // tp
    gather = EmulatedGather(device, tp, shard, ROWS)
    rng = random.Random(tp * 1000 + vocab)
    previous = None
    for call in range(2000):
        rows = rng.choice([m for m in ROWS if m != previous])  # M changes every call
        previous = rows
        shards = _shards(tp, rows, shard, device)
        _poison_allocator(rows, tp * shard, device)
        outs = gather(shards)
        want = reference_gather(shards)
        for r, out in enumerate(outs):
            assert out.shape == (rows, tp * shard) and out.dtype == torch.bfloat16
            if not torch.equal(out.view(torch.int32), want.view(torch.int32)):
                bad = (out.view(torch.int32) != want.view(torch.int32)).nonzero()[:5].tolist()
                pytest.fail(f"call {call}, rank {r}, M={rows}: words differ at {bad}")
    gather.check()
    assert gather.armed(), "mailbox words left un-armed after the run"


def test_explicitly_poisoned_outputs():
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 8, 163840 // 8
    gather = EmulatedGather(device, tp, shard, ROWS)
    for parity, rows in enumerate((1, 64, 33, 2)):
        shards = _shards(tp, rows, shard, device)
        outs = [torch.full((rows, tp * shard // 2), POISON, dtype=torch.int32,
                           device=device).view(torch.bfloat16) for _ in range(tp)]
        gather.launch(shards, outs, parity % 2, gather.ctas[rows])
        want = reference_gather(shards).view(torch.int32)
        for out in outs:
            assert torch.equal(out.view(torch.int32), want)
    assert gather.armed()


def test_fallbacks_take_stock_bitwise():
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 4, 1024
    gather = EmulatedGather(device, tp, shard, (1, 2))
    g = gather.ranks[0]
    stock = lambda x: torch.cat([x] * tp, dim=-1)  # noqa: E731
    x = planted(5, shard, device=device)  # 5 rows: not served
    assert same_bits(g(x, stock), stock(x))
    strided = planted(2, 2 * shard, device=device)[:, ::2]  # 2 rows, not contiguous
    for bad in (x[:1].float(), x[:1].half(), x[:1, :-8], x[0], x[:1].unsqueeze(0), strided):
        got = g(bad, stock)
        assert same_bits(got, stock(bad))
    assert g.parity == 0  # no fallback touched the mailbox


def test_dead_rank_times_out_and_gpu_recovers():
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 4, 4096
    gather = EmulatedGather(device, tp, shard, (1, 4), budget_s=0.5)
    shards = _shards(tp, 4, shard, device)
    start = time.monotonic()
    gather(shards, skip=(2,))
    torch.cuda.synchronize(device)
    waited = time.monotonic() - start
    print(f"\ntimeout: a dead virtual rank was reported after {waited:.3f} s (budget 0.5 s)")
    assert waited < 0.5 + 1.0, f"timed-out gather took {waited:.2f} s"
    with pytest.raises(GatherTimeout, match=r"rank\(s\) 2 never published"):
        gather.ranks[0](shards[0], lambda x: None)
    # Afterwards: stock until reset, then a correct gather again.
    assert gather.ranks[0](shards[0], lambda x: "stock") == "stock"
    gather.reset()
    shards = _shards(tp, 4, shard, device)
    outs = gather(shards)
    want = reference_gather(shards)
    assert all(torch.equal(o.view(torch.int32), want.view(torch.int32)) for o in outs)
    assert gather.armed()
