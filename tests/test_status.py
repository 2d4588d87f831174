"""The host side of a give-up (CPU): the record names the missing ranks; in serving,
the watcher logs that once, from host memory alone, as soon as the flag is up."""

import logging
import time

from lamport_head.kernels.protocol import STATUS_EPOCH, STATUS_FLAG, STATUS_PEERS, STATUS_SLOW
from lamport_head.status import GatherTimeout, StatusRecord, Watcher


def _give_up(record, epoch, missing):
    """What the kernel writes: details, then the flag."""
    for r in missing:
        record.words[STATUS_PEERS + r] = 1
    record.words[STATUS_EPOCH] = epoch
    record.words[STATUS_FLAG] = 1


def test_the_record_names_every_missing_rank():
    record = StatusRecord(rank=0, tp=4)
    assert not record.raised
    _give_up(record, 41, [1, 3])
    assert record.raised
    failure = record.failure()
    assert isinstance(failure, GatherTimeout) and failure.peers == (1, 3) and failure.epoch == 41
    assert "rank(s) 1, 3 never published" in str(failure) and "reset()" in str(failure)
    assert "stopped this process's GPU context" in str(record.failure(stopped=True))
    record.clear()
    assert not record.raised


def test_the_watcher_logs_once_naming_the_ranks(caplog):
    record = StatusRecord(rank=2, tp=4)
    watcher = Watcher(record, period_s=0.01)
    with caplog.at_level(logging.ERROR, logger="lamport_head"):
        time.sleep(0.05)
        assert not caplog.records  # nothing before the flag
        _give_up(record, 60, [3])
        deadline = time.monotonic() + 2
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
    watcher.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("lamport-head gather on rank 2: call 60 gave up waiting: rank(s) 3 "
                               "never published; the gather stopped this process's GPU context")
    assert "pinned status record" in lines[0]


def test_a_stopped_watcher_says_nothing(caplog):
    record = StatusRecord(rank=0, tp=2)
    watcher = Watcher(record, period_s=0.01)
    watcher.stop()
    time.sleep(0.03)
    with caplog.at_level(logging.ERROR, logger="lamport_head"):
        _give_up(record, 5, [1])
        time.sleep(0.05)
    assert not caplog.records


def _watch(record, stopped, stop_after_s=0.05, lines=None):
    """A watcher with a stand-in context probe (``stopped``) and exit (recorded; the
    CRITICAL line it was handed goes to ``lines``)."""
    ended = []

    def end(line):
        ended.append(time.monotonic())
        if lines is not None:
            lines.append(line)

    watcher = Watcher(record, period_s=0.01, stop_after_s=stop_after_s, stopped=stopped, end=end)
    return watcher, ended


def _until(cond, limit=2.0):
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_watchdog_ends_a_process_whose_context_did_not_stop(caplog):
    """The trap was due and the context still runs (the hang measured on the H200):
    the process ends, after a CRITICAL line naming the missing rank, and not before
    ``stop_after_s`` after the flag."""
    record = StatusRecord(rank=1, tp=4)
    critical = []
    watcher, ended = _watch(record, stopped=lambda: False, stop_after_s=0.2, lines=critical)
    with caplog.at_level(logging.ERROR, logger="lamport_head"):
        _give_up(record, 60, [3])
        flagged = time.monotonic()
        _until(lambda: ended)
    watcher.stop()
    assert len(ended) == 1 and ended[0] - flagged >= 0.2
    assert len(critical) == 1, critical
    assert "rank 1: the GPU context did not stop" in critical[0]
    assert "rank(s) 3 never published" in critical[0] and "exit code 70" in critical[0]


def test_the_watchdog_leaves_a_stopped_context_to_the_engine(caplog):
    """The trap stopped the context as designed: the engine's next CUDA call raises;
    the watcher logs the ranks once and ends nothing."""
    record = StatusRecord(rank=0, tp=2)
    asked = []
    watcher, ended = _watch(record, stopped=lambda: asked.append(1) or True)
    with caplog.at_level(logging.ERROR, logger="lamport_head"):
        _give_up(record, 7, [1])
        _until(lambda: asked)
        time.sleep(0.1)
    watcher.stop()
    assert asked == [1] and ended == []
    assert [r.levelno for r in caplog.records] == [logging.ERROR]


def test_a_gather_closed_before_the_trap_is_due_ends_nothing():
    record = StatusRecord(rank=0, tp=2)
    watcher, ended = _watch(record, stopped=lambda: False, stop_after_s=0.3)
    _give_up(record, 3, [1])
    time.sleep(0.1)  # flag seen, trap not yet due
    watcher.stop()
    time.sleep(0.4)
    assert ended == []


def test_the_context_probe_reads_a_sync_that_raises_as_stopped(monkeypatch):
    """``context_stopped``: a device sync that raises is a stopped context; one that
    returns, or blocks past the wait, is a context still running."""
    import threading

    import torch

    from lamport_head import status

    def raising(device):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "synchronize", raising)
    assert status.context_stopped("cuda:0", wait_s=1.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    assert not status.context_stopped("cuda:0", wait_s=1.0)

    def capturing(device):  # another thread's global-mode capture: no verdict on us
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "synchronize", capturing)
    assert not status.context_stopped("cuda:0", wait_s=1.0)
    hold = threading.Event()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: hold.wait(5))
    started = time.monotonic()
    assert not status.context_stopped("cuda:0", wait_s=0.1)
    assert time.monotonic() - started < 1.0
    hold.set()


def _slow(record, epoch):
    """What a serving launch still waiting at half the budget writes (0: cleared)."""
    record.words[STATUS_SLOW] = 0 if epoch is None else epoch + 1


def _stuck_watch(record, stopped, stuck_after_s=0.2, lines=None):
    ended = []

    def end(line):
        ended.append(time.monotonic())
        if lines is not None:
            lines.append(line)

    watcher = Watcher(record, period_s=0.01, stop_after_s=5.0, stuck_after_s=stuck_after_s,
                      stopped=stopped, end=end)
    return watcher, ended


def test_a_launch_stuck_before_its_record_ends_the_process(caplog):
    """The slow heartbeat stays up, no flag ever comes, the context still runs (a
    kernel stuck in a store to a dead peer): CRITICAL naming the call, then the end,
    not before ``stuck_after_s``."""
    record = StatusRecord(rank=2, tp=4)
    lines = []
    watcher, ended = _stuck_watch(record, stopped=lambda: False, lines=lines)
    with caplog.at_level(logging.ERROR, logger="lamport_head"):
        _slow(record, 41)
        up = time.monotonic()
        _until(lambda: ended)
    watcher.stop()
    assert len(ended) == 1 and ended[0] - up >= 0.2
    (line,) = lines
    assert "rank 2: call 41 has waited past its spin budget and neither finished" in line
    assert "the missing rank(s) unknown: no rank could tell" in line  # the record names none
    assert caplog.records == []  # the line is the end's to write (end_process)


def test_a_stuck_launch_names_the_missing_ranks_the_record_holds():
    """Item 2 (host side): the record's missing ranks (written by the kernel with no
    flag yet) are named on the stuck path; "unknown" only when it holds none."""
    record = StatusRecord(rank=0, tp=4)
    for r in (1, 3):
        record.words[STATUS_PEERS + r] = 1
    lines = []
    watcher, ended = _stuck_watch(record, stopped=lambda: False, lines=lines)
    _slow(record, 8)
    _until(lambda: ended)
    watcher.stop()
    (line,) = lines
    assert "rank 0: call 8 has waited past its spin budget" in line
    assert "rank(s) 1, 3 never published" in line and "unknown" not in line


def test_a_slow_launch_that_finishes_ends_nothing(caplog):
    """Slow but in time: the kernel clears the heartbeat; a later slow launch starts
    the clock again."""
    record = StatusRecord(rank=0, tp=2)
    watcher, ended = _stuck_watch(record, stopped=lambda: False, stuck_after_s=0.3)
    with caplog.at_level(logging.ERROR, logger="lamport_head"):
        _slow(record, 7)
        time.sleep(0.2)
        _slow(record, None)  # finished in time
        time.sleep(0.2)
        _slow(record, 9)
        time.sleep(0.2)  # 0.2 s of the new launch: under its own 0.3 s
        _slow(record, 10)  # the next launch slow too: its own clock
        time.sleep(0.2)
        _slow(record, None)
        time.sleep(0.4)
    watcher.stop()
    assert ended == [] and caplog.records == []


def test_a_slow_launch_that_gives_up_takes_the_flags_path(caplog):
    record = StatusRecord(rank=1, tp=4)
    asked = []
    watcher, ended = _stuck_watch(record, stopped=lambda: asked.append(1) or True,
                                  stuck_after_s=0.2)
    watcher.stop_after_s = 0.05
    with caplog.at_level(logging.ERROR, logger="lamport_head"):
        _slow(record, 60)
        time.sleep(0.05)
        _give_up(record, 60, [3])
        _until(lambda: asked)
        time.sleep(0.3)
    watcher.stop()
    assert ended == [] and asked == [1]
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
