"""Small payloads through the BF16 gather, bitwise (issue 32 item 2): ``lamport_head.candidates``
packs fp32 / int64 / bf16 / fp16 rows so that no 32-bit word is the mailbox's sentinel,
the one word the kernel does not move unchanged (it arrives as (+0, +0): modelled here by
``reference.reference_gather`` and by the stand-in kernel's launch).

- pack / unpack round trip; every packed word over all 65536 halves is not the sentinel;
- the gather, modelled (``reference_gather`` of the ranks' packed rows) and through a real
  ``HeadGather`` built on 2 gloo ranks with the CPU stand-in of its kernel
  (``helpers.fake_cuda``; its launch all-gathers the shards and scrubs sentinel words, as
  the kernel does): bitwise ``torch.cat`` of the ranks' payloads for fp32 (-0.0, NaN
  payloads, +-Inf, ties, large indices as floats), int64, bf16, fp16, k in {1, 2, 5};
- ``SmallGather`` takes the engine's stock for rows the gather does not serve and for other
  shapes and dtypes, and never stock for served rows;
- a naive BF16 view of the payload (no packing) does lose -0.0 (the models above are not
  blind to the sentinel).
"""

import pytest
import torch
from helpers import no_stock, same_bits

from lamport_head.candidates import SmallGather, pack, packed_width, unpack
from lamport_head.plan import uniform
from lamport_head.kernels.protocol import FRAGMENT_BF16, SENTINEL_I32
from lamport_head.tuning.support.reference import reference_gather

DTYPES = (torch.float32, torch.int64, torch.bfloat16, torch.float16)
KS = (1, 2, 5)
ROWS = (1, 3, 64)
FP32_SPECIAL = (0x80000000, 0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000,
                0x00000000, 0x4B7FFFFF, 0x4B800000, 0x00000001, 0x80000001)
"""-0.0, quiet NaN with payload bits, negative NaN, signalling NaN, +Inf, -Inf, +0.0,
16777215.0 and 16777216.0 (the largest exact index floats), denormals of both signs."""
INT64_SPECIAL = (0x80000000, -0x80000000, -1, 0, 2**62 + 0x80000000, -2**63, 2**63 - 1,
                 0x8000000080000000 - 2**64, 163839, 2**31)


def payload(m, cols, dtype, seed):
    """Fresh ``[m, cols]`` of ``dtype`` from random bits, with the dtype's special values
    planted (-0.0, NaN payloads, +-Inf, large indices, sentinel-shaped halves) and ties
    (a row's first value repeated)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(-2**15, 2**15, (m, cols * size // 2), generator=g, dtype=torch.int16)
    x = bits.view(dtype).clone()
    if dtype == torch.float32:
        special = torch.tensor(FP32_SPECIAL, dtype=torch.int64).to(torch.int32).view(dtype)
    elif dtype == torch.int64:
        special = torch.tensor(INT64_SPECIAL, dtype=torch.int64)
    else:
        special = torch.tensor([0x8000, 0x7FC1, 0xFFC3, 0x7C00, 0xFC00, 0x0000, 0x7E01],
                               dtype=torch.int32).to(torch.int16).view(dtype)
    flat = x.view(-1)
    for i in range(flat.numel()):
        if i % 3 == 0:
            flat[i] = special[(i // 3) % len(special)]
    if cols > 1:
        x[:, -1] = x[:, 0]  # ties
    return x


def cases():
    for dtype in DTYPES:
        for k in KS:
            yield dtype, k
    yield torch.float32, 2  # get_top_tokens' (value, index) pair (already above: kept apart)


@pytest.mark.parametrize("dtype,cols", list(cases()))
def test_pack_unpack_round_trip_and_modelled_gather_are_bitwise(dtype, cols):
    for m in ROWS:
        ranks = [payload(m, cols, dtype, seed=100 * r + m) for r in range(4)]
        packed = [pack(x) for x in ranks]
        width = packed_width(cols, dtype)
        assert packed[0].dtype == torch.bfloat16 and packed[0].shape == (m, width)
        assert width % FRAGMENT_BF16 == 0
        assert same_bits(unpack(packed[0], 1, cols, dtype), ranks[0])
        for tp in (2, 4):
            gathered = reference_gather(packed[:tp])  # the kernel's bytes, sentinel scrubbed
            assert same_bits(unpack(gathered, tp, cols, dtype), torch.cat(ranks[:tp], dim=1))


def test_no_packed_word_is_the_sentinel_over_every_half():
    halves = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    x = halves.view(1, -1)  # all 65536 halves, each as one int16 value
    for dtype, view in ((torch.bfloat16, x.view(torch.bfloat16)), (torch.float16,
                                                                    x.view(torch.float16)),
                        (torch.float32, x.view(torch.float32)), (torch.int64,
                                                                 x.view(torch.int64))):
        words = pack(view).view(torch.int32)
        assert not (words == SENTINEL_I32).any(), dtype
        assert ((words >> 16) == 0).all()  # the invariant: every word's high half is zero
        assert same_bits(unpack(reference_gather([pack(view)]), 1, view.shape[1], dtype), view)


def test_packed_widths():
    assert packed_width(2, torch.float32) == FRAGMENT_BF16  # get_top_tokens: one fragment
    assert packed_width(1, torch.float32) == FRAGMENT_BF16  # log_partition
    assert packed_width(5, torch.int64) == 40 and packed_width(5, torch.bfloat16) == 16
    for cols, dtype in ((1, torch.uint8), (3, torch.int8), (0, torch.float32)):
        with pytest.raises(ValueError):
            packed_width(cols, dtype)


def test_a_naive_bf16_view_loses_negative_zero():
    """What packing prevents: an fp32 -0.0 viewed as BF16 is the sentinel word."""
    x = torch.tensor([[-0.0, 1.0]])
    gathered = reference_gather([x.view(torch.bfloat16)] * 2).view(torch.float32)
    assert not same_bits(gathered, torch.cat([x, x], dim=1))


class Gather:
    """A HeadGather-shaped callable serving ``rows``: the modelled kernel."""

    def __init__(self, rows, tp, ranks):
        self.rows, self.tp, self.ranks, self.calls = frozenset(rows), tp, ranks, []

    def __call__(self, packed, stock):
        if packed.shape[0] not in self.rows:
            return stock(packed)
        self.calls.append(tuple(packed.shape))
        return reference_gather([packed] + [pack(x) for x in self.ranks[1:]])


def test_small_gather_serves_its_rows_and_nothing_else():
    ranks = [payload(4, 2, torch.float32, seed=r) for r in range(2)]
    gather = Gather((4,), 2, ranks)
    small = SmallGather(gather, 2, 2, torch.float32)
    got = small(ranks[0], stock=no_stock("served rows must not take stock"))
    assert same_bits(got, torch.cat(ranks, dim=1)) and gather.calls == [(4, 8)]
    for x in (ranks[0][:3], ranks[0].double(), ranks[0][:, :1], ranks[0].view(-1)):
        assert small(x, stock=lambda t: ("stock", tuple(t.shape), t.dtype)) == (
            "stock", tuple(x.shape), x.dtype)
    assert gather.calls == [(4, 8)]  # none of them reached the gather


def test_small_gather_takes_stock_when_the_gather_declines():
    """A gather without ``rows`` that hands its stock the packed rows: the engine's
    stock of the original tensor answers, not the packed one."""
    x = payload(2, 2, torch.float32, seed=5)

    def declining(packed, stock):
        return stock(packed)

    got = SmallGather(declining, 2, 2, torch.float32)(x, stock=lambda t: ("stock", t))
    assert got[0] == "stock" and got[1] is x


# ---- through a real HeadGather on 2 gloo ranks (the CPU stand-in of the kernel) -------

def _rank(rank, world):
    import ctypes

    import torch.distributed as dist
    from helpers import fake_cuda

    from lamport_head.head_gather import HeadGather
    from lamport_head.status import RECOVERABLE
    from lamport_head.tuning.support.reference import scrub

    launches = []

    def launch(shard, out, peers, r, ctas, budget, status, stream):
        """The kernel's stand-in: the all-gather it does, sentinel words scrubbed."""
        launches.append(list(shard.shape))
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous())
        full = scrub(torch.cat(parts, dim=1)).contiguous()
        ctypes.memmove(out, full.data_ptr(), full.numel() * full.element_size())

    fake_cuda(setattr, rank, "ok", launch=launch)
    out, gathers = {}, {}
    for dtype, cols in cases():
        width = packed_width(cols, dtype)
        if width not in gathers:  # one gather per packed width, as install builds them
            gathers[width] = HeadGather(None, torch.device("cpu"), world, rank, width,
                                        uniform(ROWS, 2), mode=RECOVERABLE)
        small = SmallGather(gathers[width], world, cols, dtype)
        for m in ROWS:
            mine = payload(m, cols, dtype, seed=1000 * rank + m)
            want = torch.cat([payload(m, cols, dtype, seed=1000 * r + m) for r in range(world)],
                             dim=1)
            del launches[:]
            got = small(mine, stock=no_stock("served rows must not take stock"))
            out[f"{dtype} k={cols} m={m}"] = [same_bits(got, want), launches[:]]
    return out


def test_through_a_head_gather_on_two_ranks(tmp_path):
    from spawn import spawn

    for result in spawn(_rank, 2, tmp_path):
        assert result and all(equal for equal, _ in result.values()), result
        for name, (_, launched) in result.items():
            m = int(name.split("m=")[1])
            k = int(name.split("k=")[1].split()[0])
            dtype = getattr(torch, name.split()[0].removeprefix("torch."))
            assert launched == [[m, packed_width(k, dtype)]], name
