"""The stock gather on gloo ranks (CPU): vLLM's layout, bitwise, and calls that
allocate nothing (so a harness can agree on its allocation once, before the ranks
meet, and then call it on every rank: see tuning.harness)."""

import contextlib
import warnings

import torch
from helpers import same_bits
from spawn import spawn

ROWS, SHARD = 3, 16


def _shard(rank, call):
    g = torch.Generator().manual_seed(100 * call + rank)
    return torch.randn(ROWS, SHARD, generator=g).to(torch.bfloat16)


@contextlib.contextmanager
def _no_allocation():
    """``torch.empty`` raising inside (a stock call allocates nothing); yields the
    warnings raised inside."""
    empty = torch.empty

    def refuse(*args, **kwargs):
        raise AssertionError("a stock call allocated")

    torch.empty = refuse
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.empty = empty


def _refusal(stock, *args):
    """``stock(*args)``'s ValueError message ("no error" when it takes them)."""
    try:
        stock(*args)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _worker(rank, world):
    from lamport_head.tuning.support.stock import StockGather, all_gather_logits

    stock = StockGather(ROWS, SHARD)
    outs = []
    with _no_allocation() as caught:  # no deprecated torch call of ours either
        for call in range(2):  # distinct data each call: the one buffer is overwritten
            got = stock(_shard(rank, call))
            want = torch.cat([_shard(r, call) for r in range(world)], dim=1)
            outs.append(same_bits(got, want))
    fresh = all_gather_logits(_shard(rank, 5).float())  # any dtype, a fresh tensor
    want = torch.cat([_shard(r, 5).float() for r in range(world)], dim=1)
    outs.append(torch.equal(fresh, want) and fresh.data_ptr() != stock.out.data_ptr())
    outs.append(_refusal(stock, _shard(rank, 0)[:2]))
    outs.append([f"{w.category.__name__}: {w.message}" for w in caught])
    return outs


def test_stock_gather_is_vllms_layout_and_allocates_nothing_per_call(tmp_path):
    for r in spawn(_worker, 3, tmp_path, deadline_s=60):
        assert r[:3] == [True, True, True]
        assert r[3].startswith(f"stock gather built for contiguous [{ROWS}, {SHARD}]")
        assert r[4] == []  # torch 2.13: all_gather_into_tensor warns (FutureWarning) per call


SPLITS = ([1, 0, 2], [0, 0, 3], [1, 1, 1])  # a rank with no rows, all rows to one, even


def _all_to_all_worker(rank, world):
    from lamport_head.tuning.support.reference import reference_all_to_all, scrub
    from lamport_head.tuning.support.stock import StockAllToAll, all_to_all_logits

    stocks = [StockAllToAll(sum(s), SHARD) for s in SPLITS]
    outs = []
    with _no_allocation() as caught:
        for call, (splits, stock) in enumerate(zip(SPLITS * 2, stocks * 2)):
            got = stock(_shard(rank, call), splits, splits[rank])
            shards = [_shard(r, call) for r in range(world)]
            at = sum(splits[:rank])
            want = torch.cat(shards, dim=1)[at:at + splits[rank]]
            outs.append([list(got.shape), same_bits(got, want),
                         same_bits(scrub(got), reference_all_to_all(shards, splits)[rank])])
    fresh = all_to_all_logits(_shard(rank, 5).float(), [1] * world)  # any dtype, a fresh tensor
    want = torch.cat([_shard(r, 5).float() for r in range(world)], dim=1)
    outs.append(torch.equal(fresh, want[rank:rank + 1])
                and fresh.data_ptr() != stocks[2].out.data_ptr())
    outs.append(_refusal(stocks[0], _shard(rank, 0)[:2], SPLITS[0], SPLITS[0][rank]))
    outs.append([f"{w.category.__name__}: {w.message}" for w in caught])
    return outs


def test_stock_all_to_all_is_vllms_layout_and_allocates_nothing_per_call(tmp_path):
    """vLLM's all_to_all_vocab_shards (all_to_all_single, then the permute) on gloo: rank
    r gets rows ``splits[:r]`` of every shard side by side, empty ranks included, each
    call into the one buffer of its split, no allocation, no deprecated call."""
    for rank, r in enumerate(spawn(_all_to_all_worker, 3, tmp_path, deadline_s=60)):
        assert r[:6] == [[[s[rank], 3 * SHARD], True, True] for s in SPLITS * 2]
        assert r[6] is True
        assert r[7].startswith(f"stock all-to-all built for contiguous [{ROWS}, {SHARD}]")
        assert r[8] == []
