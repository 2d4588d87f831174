"""The host side of a gather's give-up: the status record, the error that names the
missing ranks, and (serving) the watcher that says so in the log when the GPU
context has stopped.

The record is pinned host memory the kernel writes and the host reads with no
device sync (layout: ``kernels.protocol``): details first, a system-scope fence,
then the flag. Host memory stays readable after the CUDA context died, which is
what a serving gather's give-up does (``trap``): the engine's next CUDA call raises
a bare "unspecified launch failure", and only this record can say which rank never
published. The watcher reads the flag a few times a second and logs that once.

The watcher is also the serving path's watchdog, as NCCL's is for its collectives:
the kernel raises the flag an eighth of the budget before it traps
(``kernels.protocol.STOP_SHIFT``), so once the trap is due (plus ``STOP_GRACE_S`` for
the driver to surface it) the watcher asks the
context whether it stopped. If it did not (measured on one H200, 4 processes, a
killed peer: in every run one of the three survivors' traps never surfaced and its
token copy waited for ever), the watcher ends the process (``STOP_EXIT_CODE``) after
logging why: a step with missing data can never finish, and a process that neither
raises nor exits would hang the engine.
"""

import ctypes
import logging
import os
import sys
import threading
import time

import torch

from .collective import within
from .kernels.protocol import STATUS_EPOCH, STATUS_FLAG, STATUS_PEERS, STATUS_SLOW, STATUS_WORDS

logger = logging.getLogger("lamport_head")

WATCH_PERIOD_S = 0.05  # how soon after a serving give-up its log line appears
# After the trap is due: how long the driver may take to surface it (measured on one
# H200: 0.3-1.0 s with 2-4 processes time-slicing the GPU), then how long the probe of
# the context may block before the watcher takes the context for stuck.
STOP_GRACE_S, PROBE_WAIT_S = 0.6, 0.3
STOP_EXIT_CODE = 70  # a serving process whose GPU context did not stop (EX_SOFTWARE)
# What a gather does when it gives up (HeadGather's ``mode``; kernels.protocol):
RECOVERABLE = "recoverable"  # NaN for the missing fragments, raise, a collective reset()
SERVING = "serving"  # stop the GPU context (trap): no later kernel uses the step
MODES = (RECOVERABLE, SERVING)


class GatherTimeout(RuntimeError):
    """A gather gave up waiting for fragments some ranks never pushed, in call
    ``epoch`` of every rank (its own wait ran out, or a peer's did and marked it)."""

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
        self.address = self.words.data_ptr()  # what the kernel is handed
        self._flag = ctypes.c_int32.from_address(self.address + 4 * STATUS_FLAG)
        self._slow = ctypes.c_int32.from_address(self.address + 4 * STATUS_SLOW)

    @property
    def slow(self) -> int:
        """Serving's heartbeat: the epoch + 1 of a launch still waiting at half the
        budget, 0 when none (``kernels.protocol``; host memory, no sync)."""
        return self._slow.value

    @property
    def raised(self) -> bool:
        """The flag, read from host memory (no device sync, works with the context dead)."""
        return bool(self._flag.value)

    def failure(self, stopped=False):
        """The ``GatherTimeout`` the record describes (call it once ``raised``)."""
        record = self.words.tolist()
        missing = [r for r in range(self.tp) if record[STATUS_PEERS + r]]
        return GatherTimeout(self.rank, missing, record[STATUS_EPOCH], stopped)

    def clear(self):
        self.words.zero_()


def context_stopped(device, wait_s=PROBE_WAIT_S) -> bool:
    """Whether ``device``'s CUDA context in this process has stopped (a device sync
    raises its sticky error). A sync that returns, is still blocked after ``wait_s``,
    or is refused because another thread is capturing a graph, means the context
    still runs (the sync goes on in a daemon thread, harmlessly)."""
    try:
        within(wait_s, "the CUDA context probe", torch.cuda.synchronize, device)
    except TimeoutError:  # still blocked: the context runs
        return False
    except Exception as exc:  # the context's sticky error: it stopped
        return "capturing" not in str(exc)
    return False


def end_process(code=STOP_EXIT_CODE):
    """The watchdog's last resort: flush what was logged, then leave at once (no
    teardown: a CUDA call could wait on the stuck context)."""
    for handler in logging.getLogger("lamport_head").handlers + logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    sys.stderr.flush()
    os._exit(code)


class Watcher:
    """Serving only: a daemon thread that, once the record's flag is up, logs the
    failure once at ERROR (the give-up stopped the context, so the engine's own error,
    "CUDA error: unspecified launch failure", cannot name the rank; this line does),
    then, ``stop_after_s`` later (when the kernel's trap is due, plus
    ``STOP_GRACE_S``), checks that the context stopped; if not, logs that at CRITICAL
    and ends the process (``end_process``). Before any flag, a slow heartbeat
    (``StatusRecord.slow``: a launch still waiting at half the budget) that stays up
    ``stuck_after_s`` with no flag and the context still running means the launch is
    stuck before its record: the same CRITICAL line and end. Until the flag it touches no CUDA state;
    ``stop()`` ends it. ``stopped`` and ``end`` are the context probe and the exit
    (``context_stopped`` and ``end_process``; tests pass their own)."""

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
                logger.error("%s (read from the pinned status record after the GPU context "
                             "stopped)", failure)
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
                logger.critical("lamport-head gather on rank %d: call %d has waited past its "
                                "spin budget and neither finished nor gave up (its GPU context "
                                "is still running %.1f s after it passed half the budget: a "
                                "store into a peer whose context died?); ending this process "
                                "(exit code %d)", self.record.rank, slow - 1,
                                self.stuck_after_s, STOP_EXIT_CODE)
                self._end()
                return

    def _watchdog(self, failure):
        if self._done.wait(self.stop_after_s) or self._stopped():
            return  # closed meanwhile, or the trap stopped the context as designed
        logger.critical("lamport-head gather on rank %d: the GPU context did not stop %.1f s "
                        "after call %d gave up (rank(s) %s never published); ending this "
                        "process (exit code %d) so that no step with missing data can finish",
                        self.record.rank, self.stop_after_s, failure.epoch,
                        ", ".join(map(str, failure.peers)) or "unknown", STOP_EXIT_CODE)
        self._end()

    def stop(self):
        self._done.set()
