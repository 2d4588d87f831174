"""HeadGather's routing, parity and timeout handling with the kernel replaced by a
recording fake (no GPU): what launches, with which parity, and what takes stock."""

import ctypes

import pytest
import torch

from lamport_head.head_gather import GatherTimeout, HeadGather, default_ctas
from lamport_head.kernels import STATUS_PEERS

TP, SHARD = 4, 64


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, shard, out, peers, parity, rank, ctas, budget, status):
        assert isinstance(out, int) and isinstance(peers, int)  # addresses, not tensors
        self.calls.append((tuple(shard.shape), parity, rank, ctas))


def fake_gather(rows=(1, 2, 4)):
    g = HeadGather.__new__(HeadGather)
    rec = Recorder()
    g.device, g.tp, g.rank, g.shard, g.width = torch.device("cpu"), TP, 1, SHARD, TP * SHARD
    g._index = -1  # what Tensor.get_device() answers for CPU tensors
    g.rows, g.cap, g.parity, g.group, g.failed = frozenset(rows), max(rows), 0, None, None
    g._route = {m: (rec, 10 + m) for m in rows}
    g.ctas = {m: 10 + m for m in rows}
    g._peers, g.budget_ns = 1234, 10**9
    g._status = torch.zeros(STATUS_PEERS + TP, dtype=torch.int32)
    g._status_address = g._status.data_ptr()
    g._flag = ctypes.c_int32.from_address(g._status_address)
    return g, rec


@pytest.fixture(autouse=True)
def no_capture(monkeypatch):
    # CPU builds of torch cannot answer the capture query; serving runs on CUDA.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def stock(x):
    return torch.cat([x] * TP, dim=-1)


def bits(x):
    return x.contiguous().view(torch.uint8)


def test_served_rows_launch_with_alternating_parity():
    g, rec = fake_gather()
    for m in (1, 2, 4, 2, 1):
        out = g(torch.randn(m, SHARD).bfloat16(), stock)
        assert out.shape == (m, TP * SHARD) and out.dtype == torch.bfloat16
    assert [c[1] for c in rec.calls] == [0, 1, 0, 1, 0]
    assert [c[3] for c in rec.calls] == [11, 12, 14, 12, 11]
    assert all(c[2] == 1 for c in rec.calls)


@pytest.mark.parametrize("bad", [
    torch.randn(3, SHARD).bfloat16(),  # rows not served
    torch.randn(0, SHARD).bfloat16(),  # M = 0
    torch.randn(8, SHARD).bfloat16(),  # above cap
    torch.randn(2, SHARD).half(),
    torch.randn(2, SHARD).float(),
    torch.randn(2, SHARD - 8).bfloat16(),  # wrong width
    torch.randn(SHARD).bfloat16(),  # 1-D
    torch.randn(1, 2, SHARD).bfloat16(),  # 3-D
    torch.randn(2, 2 * SHARD).bfloat16()[:, ::2],  # not contiguous
])
def test_fallbacks_are_stock_bitwise_and_leave_parity(bad):
    g, rec = fake_gather()
    got = g(bad, stock)
    assert torch.equal(bits(got), bits(stock(bad)))
    assert rec.calls == [] and g.parity == 0


def test_tensor_on_another_device_takes_stock():
    g, rec = fake_gather()
    g._index = 0  # the gather lives on cuda:0; this tensor does not
    x = torch.randn(2, SHARD).bfloat16()
    assert torch.equal(bits(g(x, stock)), bits(stock(x)))
    assert rec.calls == []


def test_graph_capture_takes_stock(monkeypatch):
    g, rec = fake_gather()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = torch.randn(2, SHARD).bfloat16()
    assert torch.equal(bits(g(x, stock)), bits(stock(x)))
    assert rec.calls == []


def test_timeout_raises_once_naming_ranks_then_stock():
    g, rec = fake_gather()
    g(torch.randn(1, SHARD).bfloat16(), stock)
    g._status[1], g._status[2] = 1, 7  # what the kernel writes on expiry
    g._status[STATUS_PEERS + 0] = g._status[STATUS_PEERS + 3] = 1
    g._status[0] = 1
    x = torch.randn(1, SHARD).bfloat16()
    with pytest.raises(GatherTimeout, match=r"rank 1 timed out: rank\(s\) 0, 3 never published "
                                            r"\(parity 1, row 7\)"):
        g(x, stock)
    assert torch.equal(bits(g(x, stock)), bits(stock(x)))  # stays stock
    with pytest.raises(GatherTimeout):
        g.check()
    assert len(rec.calls) == 1


def test_default_ctas_scales_and_clamps():
    assert default_ctas(1, 8, 20480, 256, 4, 100) == 18
    assert default_ctas(64, 8, 20480, 256, 4, 100) == 100
    assert default_ctas(1, 2, 8, 256, 4, 100) == 1
