"""The host side of a gather's give-up: the status record, the error that names the
missing ranks, and (serving) the watcher that says so in the log when the GPU
context has stopped.

The record is pinned host memory the kernel writes and the host reads with no
device sync (layout: ``kernels.protocol``): details first, a system-scope fence,
then the flag. Host memory stays readable after the CUDA context died, which is
what a serving gather's give-up does (``trap``): the engine's next CUDA call raises
a bare "unspecified launch failure", and only this record can say which rank never
published. The watcher reads the flag a few times a second and logs that once.
"""

import ctypes
import logging
import threading

import torch

from .kernels.protocol import STATUS_EPOCH, STATUS_FLAG, STATUS_PEERS, STATUS_WORDS

logger = logging.getLogger("lamport_head")

WATCH_PERIOD_S = 0.05  # how soon after a serving give-up its log line appears
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


class Watcher:
    """Serving only: a daemon thread that logs the record's failure once, at ERROR,
    as soon as the flag is up. The give-up stopped the context, so the engine's own
    error ("CUDA error: unspecified launch failure") cannot name the rank; this line
    does. It touches no CUDA state and ends after its one line or ``stop()``."""

    def __init__(self, record, period_s=WATCH_PERIOD_S):
        self.record, self.period_s = record, period_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lamport-head-watcher",
                                        daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.wait(self.period_s):
            if self.record.raised:
                logger.error("%s (read from the pinned status record after the GPU context "
                             "stopped)", self.record.failure(stopped=True))
                return

    def stop(self):
        self._done.set()
