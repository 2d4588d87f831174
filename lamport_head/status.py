"""The host side of a gather's give-up: the status record, ``GatherTimeout`` and serving's
watcher (docs/design.md, "A survivor when a peer dies"). The record is pinned host memory
read with no device sync, so it stays readable after a trap killed the context.
"""

import ctypes
import ctypes.util
import logging
import os
import socket
import sys
import threading
import time

import torch

from .collective import within
from .kernels.protocol import STATUS_EPOCH, STATUS_FLAG, STATUS_PEERS, STATUS_SLOW, STATUS_WORDS

logger = logging.getLogger("lamport_head")

WATCH_PERIOD_S = 0.05  # how soon after a serving give-up its log line appears
# once the trap is due: the driver's time to surface it; the most the context probe blocks
STOP_GRACE_S, PROBE_WAIT_S = 0.6, 0.3
STOP_EXIT_CODE = 70  # a serving process whose GPU context did not stop (EX_SOFTWARE)
# the most ``logging`` may delay the watchdog's exit; the latest the armed exit fires
EXIT_LOG_WAIT_S, EXIT_BOUND_S = 0.2, 1.0
_LINE_MAX = 4096  # PIPE_BUF on Linux: a pipe write of at most this many bytes is never torn
RECOVERABLE = "recoverable"  # NaN for the missing fragments, raise, a collective reset()
SERVING = "serving"  # stop the GPU context (trap): no later kernel uses the step
MODES = (RECOVERABLE, SERVING)


class GatherTimeout(RuntimeError):
    """A gather gave up in call ``epoch`` waiting for fragments some ranks never pushed."""

    def __init__(self, rank, peers, epoch, stopped=False):
        self.rank, self.peers, self.epoch = rank, tuple(peers), epoch
        self.parity = epoch & 1
        names = ", ".join(str(p) for p in self.peers) or "unknown"
        then = ("the gather stopped this process's GPU context (serving), so no logits of "
                "that step were used; the engine's next CUDA call raises" if stopped else
                "every rank raises from its next call until a collective reset()")
        super().__init__(f"lamport-head gather on rank {rank}: call {epoch} gave up waiting: "
                         f"rank(s) {names} never published; {then}")


class StatusRecord:
    """One rank's host-visible status record (pinned where CUDA is available)."""

    def __init__(self, rank, tp):
        self.rank, self.tp = rank, tp
        self.words = torch.zeros(STATUS_WORDS, dtype=torch.int32,
                                 pin_memory=torch.cuda.is_available())
        self.address = self.words.data_ptr()
        self._flag = ctypes.c_int32.from_address(self.address + 4 * STATUS_FLAG)
        self._slow = ctypes.c_int32.from_address(self.address + 4 * STATUS_SLOW)

    @property
    def slow(self) -> int:
        """Serving's heartbeat: the epoch + 1 of a launch still waiting at half the budget."""
        return self._slow.value

    @property
    def raised(self) -> bool:
        return bool(self._flag.value)

    def missing(self) -> list:
        """The ranks ``STATUS_PEERS`` names (written before the flag); empty: none could tell."""
        record = self.words.tolist()
        return [r for r in range(self.tp) if record[STATUS_PEERS + r]]

    def failure(self, stopped=False):
        return GatherTimeout(self.rank, self.missing(), int(self.words[STATUS_EPOCH]), stopped)

    def clear(self):
        self.words.zero_()


def context_stopped(device, wait_s=PROBE_WAIT_S) -> bool:
    """Whether ``device``'s CUDA context has stopped (a sync raises its sticky error); a sync
    that returns, blocks past ``wait_s`` or is refused during a capture means it runs."""
    try:
        within(wait_s, "the CUDA context probe", torch.cuda.synchronize, device)
    except TimeoutError:
        return False
    except Exception as exc:
        return "capturing" not in str(exc)
    return False


class _SigEvent(ctypes.Structure):
    """``struct sigevent`` of Linux (glibc and musl, 64-bit): 64 bytes."""

    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p),
                ("pad", ctypes.c_int * 8)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


_SIGEV_THREAD, _CLOCK_MONOTONIC = 2, 1


def _arm_native_exit(code, after_s) -> bool:
    """A POSIX timer calling libc's ``_exit(code)`` ``after_s`` from now: it needs no GIL, so
    no Python thread can stop it. False where it cannot be armed."""
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False
    for name in (None, ctypes.util.find_library("rt")):
        try:
            libc = ctypes.CDLL(name, use_errno=True)
            create, settime, exit_now = libc.timer_create, libc.timer_settime, libc._exit
            break
        except (OSError, AttributeError, TypeError):
            continue
    else:
        return False
    event = _SigEvent(value=code, notify=_SIGEV_THREAD,
                      function=ctypes.cast(exit_now, ctypes.c_void_p).value)
    timer = ctypes.c_void_p()
    if create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        return False
    whole = int(after_s)
    when = (_TimeSpec * 2)(_TimeSpec(0, 0), _TimeSpec(whole, int((after_s - whole) * 1e9) or 1))
    return settime(timer, 0, ctypes.byref(when), None) == 0


def arm_exit(code=STOP_EXIT_CODE, after_s=EXIT_BOUND_S) -> bool:
    """``after_s`` from now the process leaves with ``code``, whatever its threads hold: the
    native timer (its answer returned) and a daemon thread, the first wins."""
    def later():
        time.sleep(after_s)
        os._exit(code)

    threading.Thread(target=later, name="lamport-head-exit", daemon=True).start()
    return _arm_native_exit(code, after_s)


def write_line(text) -> bool:
    """``text`` as one line on stderr in one write that never blocks (on a descriptor of its
    own: processes sharing the stream are untouched); True if it went out whole."""
    data = (text.rstrip("\n")[:_LINE_MAX - 1] + "\n").encode("utf-8", "replace")[:_LINE_MAX]
    try:
        fd = os.open("/proc/self/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK
                     | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        fd = None
    try:
        if fd is not None:
            return os.write(fd, data) == len(data)
        try:
            out = socket.socket(fileno=os.dup(2))
        except OSError:
            return os.write(2, data) == len(data)
        with out:
            return out.send(data, socket.MSG_DONTWAIT) == len(data)
    except OSError:  # full (EAGAIN), closed, gone: the exit goes on without it
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _log_aside(level, message, *args):
    """``logger.log(...)`` from a daemon thread, so a held handler never blocks the caller."""
    thread = threading.Thread(target=logger.log, args=(level, message, *args),
                              name="lamport-head-log", daemon=True)
    thread.start()
    return thread


def end_process(line, code=STOP_EXIT_CODE):
    """The watchdog's last resort, in an order no other thread can hold up: arm the exit,
    ``line`` to stderr, ``logging`` from a thread waited on at most ``EXIT_LOG_WAIT_S``,
    then ``_exit`` with no teardown (a CUDA call could wait on the stuck context)."""
    arm_exit(code, EXIT_BOUND_S)
    write_line(f"CRITICAL lamport_head: {line}")

    def log():
        logger.critical("%s", line)
        for handler in logger.handlers + logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:
                pass
        sys.stderr.flush()

    thread = threading.Thread(target=log, name="lamport-head-log", daemon=True)
    thread.start()
    thread.join(EXIT_LOG_WAIT_S)
    os._exit(code)


def _missing(ranks) -> str:
    if ranks:
        return f"rank(s) {', '.join(map(str, ranks))} never published"
    return "the missing rank(s) unknown: no rank could tell"


class Watcher:
    """Serving's watcher and watchdog (a daemon thread): it names the missing ranks, which the
    engine's CUDA error cannot; no CUDA state before the flag, never a wait on ``logging``."""

    def __init__(self, record, period_s=WATCH_PERIOD_S, *, device=None, stop_after_s=None,
                 stuck_after_s=None, stopped=None, end=end_process):
        self.record, self.period_s = record, period_s
        self.stop_after_s, self.stuck_after_s = stop_after_s, stuck_after_s
        self._stopped = stopped or (lambda: context_stopped(device))
        self._end = end
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lamport-head-watcher",
                                        daemon=True)
        self._thread.start()

    def _run(self):
        seen, since = 0, None  # the slow heartbeat's value, and when it came up
        while not self._done.wait(self.period_s):
            if self.record.raised:
                failure = self.record.failure(stopped=True)
                _log_aside(logging.ERROR, "%s (read from the pinned status record after the "
                           "GPU context stopped)", failure)
                if self.stop_after_s is not None:
                    self._watchdog(failure)
                return
            if self.stuck_after_s is None:
                continue
            slow = self.record.slow
            if slow != seen:
                seen, since = slow, time.monotonic()
            elif slow and time.monotonic() - since > self.stuck_after_s:
                if self.record.raised:
                    continue  # the give-up's record came: the flag's path, next round
                if self._stopped():
                    return  # the context stopped without a record: the engine's error says so
                self._end(f"lamport-head gather on rank {self.record.rank}: call {slow - 1} has "
                          f"waited past its spin budget and neither finished nor gave up (its "
                          f"GPU context is still running {self.stuck_after_s:.1f} s after it "
                          f"passed half the budget: a store into a peer whose context died?); "
                          f"{_missing(self.record.missing())}; ending this process "
                          f"(exit code {STOP_EXIT_CODE})")
                return

    def _watchdog(self, failure):
        if self._done.wait(self.stop_after_s) or self._stopped():
            return  # closed meanwhile, or the trap stopped the context as designed
        self._end(f"lamport-head gather on rank {self.record.rank}: the GPU context did not stop "
                  f"{self.stop_after_s:.1f} s after call {failure.epoch} gave up "
                  f"({_missing(failure.peers)}); ending this process (exit code "
                  f"{STOP_EXIT_CODE}) so that no step with missing data can finish")

    def stop(self):
        self._done.set()
