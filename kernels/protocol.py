"""The mailbox protocol's constants: the one definition every layer imports.

Plain Python (no DSL import), so the runtime, the tuner and the tests can read it
without compiling anything.

Mailbox of one rank, int32 words, contiguous::

    [parity 0: cap rows x W words][parity 1: cap rows x W words][control: CONTROL_WORDS]

``W = V / 2`` (a full logits row). Box words start armed with ``SENTINEL``; control
words start at 0. The peer table handed to the kernel is int64 ``[3, tp]``: rows
``PEER_PARITY0``/``PEER_PARITY1`` hold each rank's parity boxes, row ``PEER_CONTROL``
each rank's control block (addresses as mapped in the calling process). Every
rank's parity-1 box lies the same distance after its parity-0 box (one layout per
rank), which the kernel uses to pick the parity's boxes without reloading the table.
The table is written once, before any gather, so the kernel reads it before PDL's
wait.

Control block (cleared only by ``reset``), written by peers, read by its owner:
``CONTROL_MARK`` is 0, or ``MARK_TOP - s`` once some rank gave up waiting in call
``s`` (its epoch): the fail-stop mark, kept at the smallest such ``s`` (atomic max;
only two failures straddling the epoch's wrap, once in ``EPOCH_SPAN`` calls, keep the
later one, and every rank still raises, a call later);
``CONTROL_MISSING + r`` is 1 when some rank found rank ``r``'s fragments missing.
Owned by the rank's own kernels: ``CONTROL_EPOCH`` counts this rank's launches (the
parity of a call is its epoch's low bit, so eager calls and CUDA-graph replays share
one alternation) and ``CONTROL_DONE`` counts a launch's finished CTAs; the last CTA
to finish resets it and advances the epoch. The next launch on the stream reads the
epoch only after this one completed (stream order; PDL's ``griddepcontrol.wait``).

Why the status flag waits one call: a give-up in call ``s`` marks every rank, so
every rank's call ``s + 1`` fails (it starts marked, or waits for a rank that
started marked and sees the mark). Only kernels of epoch ``> s`` raise the host
flag, so every rank's flag comes from its call ``s + 1``: a host that syncs once
per step (as a serving loop does) raises at call ``s + 2`` on every rank alike.
Calls ``s`` and ``s + 1`` return NaN where fragments are missing, never stale bytes.

Two ways to give up, chosen at launch (the kernel's ``serving`` argument, 0 or 1),
one per gather; one compiled kernel holds both, so the kernel a tuner times is the
kernel serving launches (the tuner launches it with 0: a failure while tuning never
stops a context):

- recoverable (``serving`` 0; tools, tuning, tests): as above. Calls ``s`` and
  ``s + 1`` hand out NaN where fragments are missing, every rank raises from ``s + 2``
  until a collective ``reset``. A caller that must never use such a step syncs and
  calls ``check()``.
- stop (``serving`` 1; serving: engines never call ``check()``): a launch that gives
  up, or begins marked, ends in ``trap`` once all its CTAs are done: the last CTA
  copies the failed epoch and the missing ranks into the status record, fences,
  raises the flag, waits ``budget >> STOP_SHIFT`` (an eighth), then traps. Its waits
  give up at ``budget - (budget >> GIVE_UP_SHIFT)`` (three quarters), so the trap
  comes at seven eighths and the context is gone within the budget. The eighth
  between the flag and the trap is for peers giving up at the same moment: they
  write this rank's mailbox while marking, and none may write into a context that
  has already stopped (measured on one H200, 4 processes: a rank marking a peer that
  had trapped hung in its own kernel). The context is gone before any later kernel
  of the stream (the sampler, the copy of the tokens to the host) can run, so no
  value of a step with missing data is ever used; the engine's next CUDA call
  raises, and the host names the missing ranks from the status record (pinned host
  memory, readable with the context dead). Peers stop too: the give-up marked every
  rank's mailbox. The host's watcher ends the process if the trap has not stopped
  the context soon after it was due (``lamport_head.status``).

Status record (host-visible, one per rank; the kernel writes it, the host reads it
without a device sync): ``STATUS_EPOCH`` is the call ``s`` that failed and
``STATUS_PEERS + r`` is 1 for each rank recorded missing (both copied from the
control block), then a system-scope fence, then ``STATUS_FLAG``. Every writer of a
word writes the same value, so no update can be lost.

Serving's heartbeat of a slow launch: a thread of a serving launch past half the
budget writes ``STATUS_SLOW`` = its epoch + 1 (host memory) and ``CONTROL_SLOW`` = 1
(its own control block), once per thread; healthy launches write neither. The
launch's last CTA clears both when the launch finishes without a give-up (the wait
ended in time); a give-up leaves them and raises the flag. So a host that sees
``STATUS_SLOW`` stay up, with no flag, past the moment the trap was due knows the
launch is stuck before its record (a store into a peer whose context died, say).

Where a thread checks (``steps.heartbeat``; the PTX audit asserts each place): after
each poll that left fragments dirty; before each push batch after the first (a
batch's system-scope stores can stall); in thread 0 of every CTA before the release
fence of the CTA count (a fence waits for the CTA's stores); the give-up's marks come
only after a wait past three quarters of the budget (raised by then) and write the
missing ranks into ``STATUS_PEERS`` (no flag) before any store into a peer; the last
CTA's give-up raises the heartbeat, whatever the time, before the record's fences.
What no check can see: a thread stuck in one store or fence that it began before half
the budget, while every other thread of the launch is stuck too or waits at a
barrier (``bar.sync`` cannot be left on a clock). A watcher that only polls the clock
would share the SM's memory pipeline with the stuck stores (its own store to host
memory could wait behind them) and would cost every launch the poll of a progress
word at its end; that case is the host's to see (a launch not complete past the
budget and the grace, with neither heartbeat nor flag), not the kernel's.
"""

SENTINEL = 0x80000000  # "not yet published": the BF16 pair (+0, -0), the FP32 -0.0
SENTINEL_I32 = SENTINEL - (1 << 32)  # the same word as a signed int32 (torch's view)
NAN_PAIR = 0x7FC07FC0  # what a fragment that never arrived is written as
WORDS = 4  # 32-bit words per 16-byte fragment
WORD_BYTES = 4  # bytes per mailbox word
FRAGMENT_BYTES = WORD_BYTES * WORDS  # the unit of every access: 16 bytes
FRAGMENT_BF16 = FRAGMENT_BYTES // 2  # BF16 values per fragment

MAX_TP = 32
CONTROL_MARK, CONTROL_MISSING = 0, 1
MARK_TOP = 0x7FFFFFFF  # mark = MARK_TOP - failed epoch: the largest mark is the earliest call
# The epoch counts launches modulo EPOCH_SPAN. Even, so the parity alternates across the
# wrap; below 2**31, so a mark (MARK_TOP - epoch) is never 0 ("no mark") and never
# overflows however long a gather serves. A failed epoch s is behind epoch e when
# 0 < (e - s) mod EPOCH_SPAN < EPOCH_SPAN / 2.
EPOCH_SPAN = 1 << 30
CONTROL_EPOCH, CONTROL_DONE = CONTROL_MISSING + MAX_TP, CONTROL_MISSING + MAX_TP + 1
CONTROL_SLOW = CONTROL_DONE + 1  # serving: some thread of this launch raised STATUS_SLOW
CONTROL_WORDS = 4 * ((CONTROL_SLOW + 1 + 3) // 4)  # whole fragments: the boxes stay aligned
PEER_PARITY0, PEER_PARITY1, PEER_CONTROL = 0, 1, 2
PEER_ROWS = 3

STATUS_FLAG, STATUS_EPOCH, STATUS_PEERS = 0, 1, 2
STATUS_SLOW = STATUS_PEERS + MAX_TP  # serving: epoch + 1 of a launch still waiting at half the budget
STATUS_WORDS = STATUS_SLOW + 1

# The spin budget's timeline, as shifts of the budget (the kernel's integer arithmetic)
# and as the host's fractions of it (``slow_after``, ``give_up_after``, ``trap_after``):
# the slow heartbeat from half of it (SLOW_SHIFT); serving's waits end at
# budget - (budget >> GIVE_UP_SHIFT), three quarters; its trap follows the status
# record's flag by budget >> STOP_SHIFT, an eighth: seven eighths in all.
SLOW_SHIFT, GIVE_UP_SHIFT, STOP_SHIFT = 1, 2, 3


def slow_after(budget):
    """When a launch still waiting raises the slow heartbeat (a half)."""
    return budget / (1 << SLOW_SHIFT)


def give_up_after(budget):
    """When serving's waits give up (three quarters)."""
    return budget - budget / (1 << GIVE_UP_SHIFT)


def trap_grace(budget):
    """Serving's wait between the status record's flag and its trap (an eighth)."""
    return budget / (1 << STOP_SHIFT)


def trap_after(budget):
    """When a serving launch that gave up traps (seven eighths)."""
    return give_up_after(budget) + trap_grace(budget)

# Diagnostics only (``compile_gather(..., timers=True)``): thread 0 of every CTA writes
# the global timer (ns, int64) at each phase boundary into the status buffer after the
# record, at ``timer_index``: one slot per call of the last TIMER_CALLS (by epoch).
TIMER_PHASES = ("entry", "waited", "pushed", "delivered", "done")
TIMER_BASE = (STATUS_WORDS + 1) // 2  # in int64: the record's int32 words, rounded up
TIMER_CALLS = 64


def timer_index(epoch: int, cta: int, ctas: int, phase: int) -> int:
    """The int64 index of call ``epoch``'s stamp of ``phase`` by CTA ``cta`` of ``ctas``."""
    return TIMER_BASE + ((epoch % TIMER_CALLS) * ctas + cta) * len(TIMER_PHASES) + phase


def timer_words(ctas: int) -> int:
    """int32 words of a diagnostic status buffer: the record, then every call's stamps."""
    return 2 * (TIMER_BASE + TIMER_CALLS * ctas * len(TIMER_PHASES))

THREADS = (64, 128, 256, 512, 1024)  # CTA sizes the kernel compiles for
UNROLL_MAX = 16  # fragments in flight per thread, at most
DEFAULT_THREADS, DEFAULT_UNROLL = 256, 4
# Batches of this many fragments or more go through shared memory (``cp.async``;
# "staged") instead of registers, whose count would halve the CTAs per SM (measured:
# TP 8 at unroll 8, 106 registers in registers, 64 staged). ``compile_gather``'s
# default; its slots: ``staged_bytes``.
STAGED_FROM = 8


def staged(unroll: int) -> bool:
    """Whether a kernel of ``unroll`` fragments in flight per thread stages them."""
    return unroll >= STAGED_FROM


def staged_bytes(threads: int, unroll: int) -> int:
    """Dynamic shared memory of a staged kernel: one 16-byte slot per fragment in flight."""
    return threads * unroll * 4 * WORDS


def box_words(cap: int, words: int) -> int:
    """int32 words of one rank's mailbox allocation (both parities and control)."""
    return 2 * cap * words + CONTROL_WORDS
