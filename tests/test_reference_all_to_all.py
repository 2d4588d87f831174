"""``reference_all_to_all``'s own semantics, on the CPU: vLLM's
``all_to_all_vocab_shards`` as a plain torch expression (each shard split by
``send_splits``, rank q's pieces concatenated in rank order), with the gather's one
change to the bytes (sentinel words to 0), for even, uneven and empty splits."""

import pytest
import torch
from helpers import words

from lamport_head.kernels.protocol import SENTINEL_I32
from lamport_head.tuning.support.reference import (SPECIAL, offsets_of, planted,
                                                   reference_all_to_all)


def _plain(shards, splits):
    """The expression the reference must equal: split, take rank q's piece of every
    shard, concatenate along the vocab axis, scrub the sentinel word."""
    pieces = [torch.split(s, list(splits)) for s in shards]
    outs = []
    for q in range(len(shards)):
        w = words(torch.cat([p[q] for p in pieces], dim=1))
        outs.append(torch.where(w == SENTINEL_I32, 0, w))
    return outs


SPLITS = [(2, 2), (1, 3), (0, 4), (4, 0), (0, 0), (3, 1, 0, 2), (0, 0, 5, 0),
          (1, 1, 1, 1, 1, 1, 1, 1), (0, 7, 0, 1, 0, 0, 2, 3), (0,) * 8]


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_reference_all_to_all_is_split_cat_then_scrub(splits):
    tp, shard, m = len(splits), 16, sum(splits)
    g = torch.Generator().manual_seed(tp * 100 + m)
    shards = [planted(m, shard, generator=g) for _ in range(tp)]
    outs = reference_all_to_all(shards, splits)
    want = _plain(shards, splits)
    assert len(outs) == tp
    for q, (out, w) in enumerate(zip(outs, want)):
        assert out.shape == (splits[q], tp * shard) and out.dtype == torch.bfloat16
        assert torch.equal(words(out), w), f"rank {q}"
        assert not (words(out) == SENTINEL_I32).any()
        for r in range(tp):  # rank r's shard at columns r * V/TP, rank q's rows of it
            lo = sum(splits[:q])
            piece = words(shards[r][lo:lo + splits[q]])
            got = words(out)[:, r * shard // 2:(r + 1) * shard // 2]
            assert torch.equal(got, torch.where(piece == SENTINEL_I32, 0, piece))


def test_every_special_word_goes_through_but_the_sentinel():
    shards = [planted(3, 64, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    outs = reference_all_to_all(shards, (1, 2))
    seen = set(torch.cat([words(o).flatten() for o in outs]).tolist())
    assert set(SPECIAL) - {SENTINEL_I32} <= seen  # planted's first words: row 0, to rank 0
    assert SENTINEL_I32 not in seen


def test_offsets_are_the_prefix_sums_from_zero():
    assert offsets_of((3, 0, 2)) == [0, 3, 3, 5]
    assert offsets_of((0, 0)) == [0, 0, 0]
    with pytest.raises(ValueError):
        offsets_of((1, -1))


def test_reference_all_to_all_rejects_splits_that_do_not_fit():
    shards = [torch.zeros(4, 8, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="sum to"):
        reference_all_to_all(shards, (1, 2))
    with pytest.raises(ValueError, match="splits for"):
        reference_all_to_all(shards, (4,))


@pytest.mark.parametrize("splits", [(2, 2), (0, 5), (3, 0, 1, 0), (0,) * 8, (1, 2, 3, 4, 0, 0, 7, 1)])
def test_the_launch_takes_the_offsets_of_any_split(splits):
    from lamport_head.launch import check_offsets

    offsets = offsets_of(splits)
    assert check_offsets(offsets, len(splits), sum(splits)) == tuple(offsets)


@pytest.mark.parametrize("offsets, tp, rows", [
    ((0, 1, 2), 2, 4),  # ends short of M: rows 2-3 would land where no poll re-arms them
    ((0, 1, 5), 2, 4),  # past M
    ((1, 2, 4), 2, 4),  # not from 0
    ((0, 3, 2, 4), 3, 4),  # decreasing
    ((0, 2, 4), 8, 4),  # a TP 8 kernel given TP 2's offsets
    ((0, 4), 2, 4),  # one offset short
])
def test_the_launch_refuses_offsets_that_would_leave_rows_unpolled(offsets, tp, rows):
    """The kernel routes row m to the last rank q with offsets[q] <= m: offsets that do
    not cover 0..M exactly would put rows in a box no poll re-arms, and a later call of
    that parity would deliver them as valid (``launch.check_offsets``)."""
    from lamport_head.launch import check_offsets

    with pytest.raises(ValueError, match="non-decreasing row offsets from 0 to"):
        check_offsets(offsets, tp, rows)
