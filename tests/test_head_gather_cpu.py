"""HeadGather's host logic with the kernel replaced by a recording fake (no GPU):
routing, parity, stream order, the fail-stop record and ``reset``'s order."""

import types

import pytest
import torch
from helpers import no_stock, same_bits

from lamport_head import mailbox_collective
from lamport_head.status import StatusRecord
from lamport_head.config import GatherConfig, default_ctas
from lamport_head.head_gather import HeadGather
from lamport_head.status import GatherTimeout
from lamport_head.kernels.protocol import (CONTROL_MARK, CONTROL_MISSING, CONTROL_WORDS, MARK_TOP,
                                           STATUS_EPOCH, STATUS_FLAG, STATUS_PEERS)

TP, SHARD = 4, 64


class Recorder:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def __call__(self, shard, out, peers, rank, ctas, budget, status, stream):
        assert isinstance(out, int) and isinstance(peers, int)  # addresses, not tensors
        if self.fail:
            raise RuntimeError("launch failed")
        self.calls.append((tuple(shard.shape), rank, ctas, stream))


class FakeBox:
    def __init__(self, log):
        self.log = log
        self.block = torch.zeros(CONTROL_WORDS, dtype=torch.int32)

    def control(self, rank):
        return self.block

    def barrier(self):
        self.log.append("barrier")

    def arm(self):
        self.log.append("arm")


def fake_gather(rows=(1, 2, 4), log=None, dtype=torch.bfloat16):
    g = HeadGather.__new__(HeadGather)
    rec = Recorder()
    g.device, g.tp, g.rank, g.shard_width, g.width = torch.device("cpu"), TP, 1, SHARD, TP * SHARD
    g.dtype = dtype
    g._index = -1  # what Tensor.get_device() answers for CPU tensors
    g.rows, g.cap, g.group = frozenset(rows), max(rows), None
    g._launch = dict.fromkeys(rows, rec)
    g.plan = {m: GatherConfig(10 + m) for m in rows}
    g._ctas = {m: c.ctas for m, c in g.plan.items()}  # what _serve derives from the plan
    g.peers_address, g.budget_ns = 1234, 10**9
    g.mode, g._watcher = "recoverable", None
    g._status = StatusRecord(g.rank, TP)
    g.status_address = g._status.address
    g._stream_id, g._stream, g._closed = None, None, False
    g.box = FakeBox(log if log is not None else [])
    return g, rec


class FakeStream:
    def __init__(self, ident, log):
        self.ident, self.log = ident, log

    def wait_stream(self, other):
        self.log.append((self.ident, "waits for", other.ident))


@pytest.fixture
def streams(monkeypatch):
    """A fake current stream the test can switch; logs every wait."""
    state = {"now": 1, "log": []}
    monkeypatch.setattr(mailbox_collective, "_raw_stream", lambda index: state["now"])
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: FakeStream(state["now"], state["log"]))
    return state


@pytest.fixture(autouse=True)
def no_capture(monkeypatch, streams):
    # CPU builds of torch cannot answer the capture query; serving runs on CUDA.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def stock(x):
    return torch.cat([x] * TP, dim=-1)


def test_served_rows_launch_with_their_ctas():
    g, rec = fake_gather()
    for m in (1, 2, 4, 2, 1):
        out = g(torch.randn(m, SHARD).bfloat16(), stock)
        assert out.shape == (m, TP * SHARD) and out.dtype == torch.bfloat16
    assert [c[2] for c in rec.calls] == [11, 12, 14, 12, 11]
    assert all(c[1] == 1 for c in rec.calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gather_serves_its_one_dtype_and_every_other_takes_stock(dtype):
    """One gather, one dtype (``dtype=`` at construction): a call of its dtype launches
    and returns its dtype; a call of the other served dtype, or FP16, takes stock
    bitwise and launches nothing (the decision reads the call's dtype only)."""
    g, rec = fake_gather(dtype=dtype)
    out = g(torch.randn(2, SHARD).to(dtype), stock)
    assert out.dtype == dtype and out.shape == (2, TP * SHARD) and len(rec.calls) == 1
    for other in (torch.bfloat16, torch.float32, torch.float16):
        if other != dtype:
            x = torch.randn(2, SHARD).to(other)
            assert same_bits(g(x, stock), stock(x))
    assert len(rec.calls) == 1


def _misaligned(rows):
    flat = torch.randn(rows * SHARD + 1).bfloat16()
    view = flat[1:].view(rows, SHARD)  # contiguous, 2 bytes past a 16-byte boundary
    assert view.is_contiguous() and view.data_ptr() % 16
    return view


@pytest.mark.parametrize("bad", [
    torch.randn(3, SHARD).bfloat16(),  # rows not served
    torch.randn(0, SHARD).bfloat16(),  # M = 0
    torch.randn(8, SHARD).bfloat16(),  # above cap
    torch.randn(2, SHARD).half(),
    torch.randn(2, SHARD).float(),
    torch.randn(2, SHARD - 8).bfloat16(),  # wrong width
    torch.randn(SHARD).bfloat16(),  # 1-D
    torch.randn(1, 2, SHARD).bfloat16(),  # 3-D
])
def test_fallbacks_are_stock_bitwise_and_launch_nothing(bad):
    g, rec = fake_gather()
    got = g(bad, stock)
    assert same_bits(got, stock(bad))
    assert rec.calls == []  # no kernel: the device epoch (the parity) is untouched


@pytest.mark.parametrize("placed", [
    torch.randn(2, 2 * SHARD).bfloat16()[:, ::2],  # not contiguous
    _misaligned(2),  # contiguous but not 16-byte aligned
])
def test_placement_the_allocator_chose_is_copied_never_stock(placed):
    """Where a tensor sits may differ by rank: every rank must still launch."""
    g, rec = fake_gather()
    seen = []
    rec_call = rec.__call__
    g._launch[2] = lambda shard, *a: (seen.append(shard), rec_call(shard, *a))
    g(placed, no_stock("stock taken on one rank's placement"))
    (shard,) = seen
    assert shard.is_contiguous() and shard.data_ptr() % 16 == 0
    assert same_bits(shard, placed)


def test_tensor_on_another_device_raises():
    g, rec = fake_gather()
    g._index = 0  # the gather lives on cuda:0; this tensor does not
    with pytest.raises(ValueError, match="serves cuda:0"):
        g(torch.randn(2, SHARD).bfloat16(), stock)
    assert rec.calls == []


def test_a_closed_gather_raises():
    g, rec = fake_gather()
    g._closed = True
    with pytest.raises(RuntimeError, match="closed"):
        g(torch.randn(2, SHARD).bfloat16(), stock)


def test_graph_capture_records_the_launch(monkeypatch, streams):
    """Under capture the launch is recorded (the kernel keeps the parity), and the
    captured call never waits on a stream outside the capture."""
    g, rec = fake_gather()
    x = torch.randn(2, SHARD).bfloat16()
    g(x, stock)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    streams["now"] = 7  # torch.cuda.graph captures on a side stream
    out = g(x, no_stock("stock under capture"))
    assert out.shape == (2, TP * SHARD) and len(rec.calls) == 2
    assert rec.calls[1][3] == 7  # launched into the capture stream
    assert streams["log"] == []
def test_a_failed_launch_raises_and_is_not_counted():
    g, rec = fake_gather()
    g(torch.randn(1, SHARD).bfloat16(), stock)
    g._launch[2] = Recorder(fail=True)
    with pytest.raises(RuntimeError, match="launch failed"):
        g(torch.randn(2, SHARD).bfloat16(), stock)
    assert len(rec.calls) == 1


def test_a_new_stream_waits_for_the_previous_one(streams):
    g, rec = fake_gather()
    x = torch.randn(1, SHARD).bfloat16()
    g(x, stock)
    g(x, stock)
    assert streams["log"] == []  # same stream: stream order alone orders the calls
    streams["now"] = 2
    g(x, stock)
    assert streams["log"] == [(2, "waits for", 1)]
    g(x, stock)
    streams["now"] = 1
    g(x, stock)
    assert streams["log"] == [(2, "waits for", 1), (1, "waits for", 2)]
    assert [c[3] for c in rec.calls] == [1, 1, 2, 2, 1]  # each launch on the current stream


def _flag(g, epoch, peers):
    """What a kernel after the failed call writes: details first, the flag last."""
    g._status.words[STATUS_EPOCH] = epoch
    for p in peers:
        g._status.words[STATUS_PEERS + p] = 1
    g._status.words[STATUS_FLAG] = 1


def test_the_flag_raises_on_every_call_until_reset():
    g, rec = fake_gather()
    g(torch.randn(1, SHARD).bfloat16(), stock)
    _flag(g, 7, (0, 3))
    x = torch.randn(1, SHARD).bfloat16()
    for _ in range(3):  # never stock on its own: raises every time
        with pytest.raises(GatherTimeout, match=r"rank 1: call 7 gave up waiting: rank\(s\) "
                                                r"0, 3 never published"):
            g(x, stock)
    with pytest.raises(GatherTimeout):
        g(torch.randn(3, SHARD).bfloat16(), stock)  # not even a row count stock would serve
    with pytest.raises(GatherTimeout) as info:
        g.check()
    assert info.value.peers == (0, 3) and info.value.epoch == 7 and info.value.parity == 1
    assert len(rec.calls) == 1


def test_check_reads_the_mark_before_the_flag_is_up(monkeypatch):
    """The failed call itself raises no flag (every rank's comes from the call after
    it); check() after a sync sees the mark a peer left in this rank's mailbox."""
    g, rec = fake_gather()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    g.check()  # no mark: nothing to say
    g.box.block[CONTROL_MISSING + 2] = 1
    g.box.block[CONTROL_MARK] = MARK_TOP - 5
    with pytest.raises(GatherTimeout, match=r"call 5 gave up waiting: rank\(s\) 2 never"):
        g.check()
    g(torch.randn(1, SHARD).bfloat16(), stock)  # the host flag is not up yet: it launches
    assert len(rec.calls) == 1


def test_reset_order_and_recovery(monkeypatch):
    log = []
    g, rec = fake_gather(log=log)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    g(torch.randn(1, SHARD).bfloat16(), stock)
    _flag(g, 0, (0,))
    g.reset()
    # stop -> sync -> barrier -> arm -> (status cleared) -> sync -> barrier
    assert log == ["sync", "barrier", "arm", "sync", "barrier"]
    assert not g._status.words.any() and not g._status.raised
    g.check()
    g(torch.randn(1, SHARD).bfloat16(), stock)
    assert len(rec.calls) == 2


def test_default_ctas_scales_and_clamps():
    assert default_ctas(1, 8, 20480, 256, 4, 100) == 35  # 7 x 2560 fragments, 2 per thread
    assert default_ctas(1, 8, 20480, 256, 1, 100) == 70  # never more than unroll per thread
    assert default_ctas(64, 8, 20480, 256, 4, 100) == 100
    assert default_ctas(1, 2, 8, 256, 4, 100) == 1


def test_symmetric_bases_apply_this_ranks_offset_to_every_peer():
    from lamport_head.mailbox import symmetric_bases

    # handle.buffer_ptrs at the tensors themselves (offset 0)
    assert symmetric_bases([0x1000, 0x9000], 0x9000, 1) == [0x1000, 0x9000]
    # at the allocation segments' bases: the box sits 0x200 in on every rank
    assert symmetric_bases([0x1000, 0x9000, 0x5000], 0x1200, 0) == [0x1200, 0x9200, 0x5200]
    with pytest.raises(RuntimeError, match="points past this box"):
        symmetric_bases([0x2000, 0x9000], 0x1000, 0)


def test_backend_choice_is_a_function_of_every_ranks_facts():
    from lamport_head.mailbox import decide

    distinct = [("h", "gpu0"), ("h", "gpu1")]
    assert decide(distinct, [True, True]) == "ipc"  # one host: CUDA IPC, never multicast
    assert decide([("h", "gpu0"), ("h", "gpu0")], [True, True]) == "ipc"  # a shared GPU
    assert decide(distinct, [True, False]) == "ipc"  # a rank without symmetric memory
    assert decide(distinct, [True, True], "ipc") == "ipc"  # forced
    assert decide(distinct, [True, True], "symmetric") == "symmetric"  # forced
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] have no torch symmetric memory"):
        decide(distinct, [True, False], "symmetric")
    with pytest.raises(ValueError, match="LAMPORT_HEAD_MAILBOX='nvls'"):
        decide(distinct, [True, True], "nvls")


def test_closing_a_serving_gather_that_gave_up_raises_and_leaves_the_watchdog_on(monkeypatch):
    """After a serving give-up the context is stopped (or about to be ended): close()
    names the missing ranks instead of syncing a context that may never answer, and
    the watcher (the watchdog) is not stopped."""
    g, _ = fake_gather()
    log = []
    g.box = FakeBox(log)
    g.box.close = lambda: log.append("close")
    stopped = []
    g.mode, g._watcher = "serving", types.SimpleNamespace(stop=lambda: stopped.append(1))
    g._status.words[STATUS_PEERS + 3] = 1
    g._status.words[STATUS_EPOCH] = 60
    g._status.words[STATUS_FLAG] = 1
    with pytest.raises(GatherTimeout, match=r"call 60 gave up waiting: rank\(s\) 3"):
        g.close()
    assert log == [] and stopped == []
    g._status.clear()  # a serving gather that never gave up closes as before
    g.close()
    assert log == ["close"] and stopped == [1]


def test_the_base_of_the_gather_and_the_all_to_all_is_not_built_alone(monkeypatch):
    """``MailboxCollective`` names no kernel: building it refuses before any build (a
    collective build for nothing), by either constructor."""
    from lamport_head import build
    from lamport_head.mailbox_collective import MailboxCollective

    monkeypatch.setattr(build, "build", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(TypeError, match="is a base"):
        MailboxCollective(None, "cpu", 2, 0, 64, {}, mode="recoverable")
    with pytest.raises(TypeError, match="is a base"):
        MailboxCollective.default(None, "cpu", 2, 0, 64, [1], mode="recoverable")
