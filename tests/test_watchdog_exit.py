"""Issue 29 item 1 (CPU): once the watchdog decides to end a serving process, the
process ends within a bound, whatever its other threads hold.

Each case is a fresh Python process (the exit is real). Its root logging handler
writes to a pipe nobody drains and a thread logs until that pipe is full, so the
handler's lock is held for ever; then the status record's give-up flag goes up and
the context probe says "still running": the watchdog must end the process with exit
code 70, within ``stop_after_s`` + ``EXIT_BOUND_S`` of the flag, and its CRITICAL
line must reach the process's real stderr (the consumer), which logging cannot.
"""

import os
import subprocess
import sys
import textwrap
import time

from lamport_head.status import EXIT_BOUND_S, STOP_EXIT_CODE

STOP_AFTER_S = 0.2  # the stand-in watchdog's wait after the flag
SLACK_S = 1.5  # process scheduling on a loaded CI host

CHILD = textwrap.dedent("""
    import logging, os, sys, threading, time

    from lamport_head.kernels.protocol import STATUS_EPOCH, STATUS_FLAG, STATUS_PEERS
    from lamport_head.status import StatusRecord, Watcher

    read, write = os.pipe()  # never drained
    root = logging.getLogger()
    root.addHandler(logging.StreamHandler(os.fdopen(write, "w")))
    root.setLevel(logging.INFO)
    logged = [0.0]

    def chatter():  # an engine thread logging until the pipe is full: blocked in emit
        while True:
            logging.getLogger("engine").warning("x" * 512)
            logged[0] = time.monotonic()

    threading.Thread(target=chatter, daemon=True).start()
    while not logged[0] or time.monotonic() - logged[0] < 0.5:  # until it blocks
        time.sleep(0.05)
    record = StatusRecord(rank=1, tp=4)
    watcher = Watcher(record, period_s=0.01, stop_after_s=%(stop_after)r,
                      stopped=lambda: False)
    record.words[STATUS_PEERS + 3] = 1
    record.words[STATUS_EPOCH] = 60
    record.words[STATUS_FLAG] = 1
    os.write(1, b"flag up\\n")
    time.sleep(60)  # the watchdog must end this process long before
    os.write(1, b"still alive\\n")
""")

GIL_CHILD = textwrap.dedent("""
    import ctypes, os

    from lamport_head.status import arm_exit

    armed = arm_exit(70, 0.5)
    os.write(1, b"armed %d\\n" % armed)
    ctypes.PyDLL(None).sleep(30)  # libc sleep called with the GIL held: no Python thread runs
    os.write(1, b"still alive\\n")
""")


def _run(code, limit_s=30):
    """Run ``code``; (exit code, seconds from its first stdout line to its end, stdout,
    stderr)."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = proc.stdout.readline()
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, time.monotonic() - started, (first + out).decode(), err.decode()


def test_the_watchdog_exits_while_another_thread_holds_the_log_handler():
    code, took, out, err = _run(CHILD % {"stop_after": STOP_AFTER_S})
    assert out.startswith("flag up") and "still alive" not in out, (out, err)
    assert code == STOP_EXIT_CODE, (code, out, err)
    assert took < STOP_AFTER_S + EXIT_BOUND_S + SLACK_S, took
    # what reached the process's stderr: the one non-blocking write, the ranks named
    lines = [x for x in err.splitlines() if x.startswith("CRITICAL lamport_head:")]
    assert len(lines) == 1, err
    assert "rank 1: the GPU context did not stop" in lines[0]
    assert "rank(s) 3 never published" in lines[0] and "exit code 70" in lines[0]


def test_the_armed_exit_fires_with_the_gil_held():
    """The exit is armed on a clock that needs no Python thread: a thread that keeps
    the GIL (here the main thread, in a C call that never releases it) cannot hold it."""
    code, took, out, err = _run(GIL_CHILD)
    assert out.startswith("armed 1") and "still alive" not in out, (out, err)
    assert code == STOP_EXIT_CODE and took < 0.5 + SLACK_S, (code, took, err)
