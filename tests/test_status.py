"""The host side of a give-up (CPU): the record names the missing ranks; in serving,
the watcher logs that once, from host memory alone, as soon as the flag is up."""

import logging
import time

from lamport_head.kernels.protocol import STATUS_EPOCH, STATUS_FLAG, STATUS_PEERS
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
