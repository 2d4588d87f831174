"""The mailbox protocol's constants: the one definition every layer imports. Plain
Python (no DSL import). Layout, writers and readers, the two modes: docs/design.md,
the protocol.

Invariants a change must keep:

- A rank's mailbox, int32 words: ``[parity 0: cap x W][parity 1: cap x W][control]``,
  ``W = V / 2``. Box words start armed (``SENTINEL``), control words at 0. Every
  rank's parity-1 box lies the same distance after its parity-0 box, so the kernel
  picks the parity without reloading the peer table (int64 ``[PEER_ROWS, tp]``,
  written once, before any gather: read before PDL's wait).
- The control block is cleared only by ``reset``: ``CONTROL_MARK`` is 0 or
  ``MARK_TOP - s`` for the earliest failed call ``s`` (atomic max); ``CONTROL_MISSING
  + r`` is 1 once some rank found rank r missing; the ticket pair (``CONTROL_TICKETS``,
  0 between launches; ``CONTROL_EPOCH``, its low bit the parity) and ``CONTROL_DONE``
  belong to the owner's kernels.
- The host flag waits one call: only kernels of epoch > s raise it, so every rank
  raises at s + 2 alike; calls s and s + 1 return NaN where data is missing.
- Status record: the details, a system fence, then ``STATUS_FLAG``; every writer of
  a word writes the same value, so no update is lost.
- Serving's timeline (the shifts below): the slow heartbeat at 1/2 of the budget,
  the give-up at 3/4, the trap at 7/8. The eighth after the flag lets peers giving
  up at the same moment finish marking this rank: a rank marking a peer that had
  trapped hangs in its own kernel. A thread stuck in one store or fence with the
  rest at a barrier raises no heartbeat: the host's watcher sees that case
  (``lamport_head.status``), not the kernel.
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
# The epoch's ticket pair, one 64-bit word (8-byte aligned): CONTROL_TICKETS counts the
# CTAs of the running launch that took the epoch, CONTROL_EPOCH (the high half) is the
# launch count; the launch's last ticket moves the epoch on and the count back to 0
# (``steps.take_epoch``). CONTROL_DONE + parity: the CTAs of the launch of that parity
# that finished (``steps.finish``), cleared by the next launch's last ticket.
CONTROL_TICKETS = 2 * ((CONTROL_MISSING + MAX_TP + 1) // 2)
CONTROL_EPOCH = CONTROL_TICKETS + 1
CONTROL_DONE = CONTROL_EPOCH + 1
CONTROL_WORDS = 4 * ((CONTROL_DONE + 2 + 3) // 4)  # whole fragments: the boxes stay aligned
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
# A waiting thread reads its mark only once it has waited MARK_AFTER_NS: the mark only
# ends a wait early, so a spin of a normal call (µs) costs one round trip, its polls',
# and no thread loads the control line a marker writes.
MARK_AFTER_NS = 1 << 16


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
# A CTA's shared words before any staged slot: the epoch thread 0 took (one fragment, so
# the slots stay aligned).
SHARED_CONTROL_BYTES = 16


def staged(unroll: int) -> bool:
    """Whether a kernel of ``unroll`` fragments in flight per thread stages them."""
    return unroll >= STAGED_FROM


def staged_bytes(threads: int, unroll: int) -> int:
    """The staged slots' shared memory: one 16-byte slot per fragment in flight."""
    return threads * unroll * 4 * WORDS


def shared_bytes(threads: int, unroll: int, staged: bool) -> int:
    """Dynamic shared memory of a kernel: its control words, then the staged slots."""
    return SHARED_CONTROL_BYTES + (staged_bytes(threads, unroll) if staged else 0)


def box_words(cap: int, words: int) -> int:
    """int32 words of one rank's mailbox allocation (both parities and control)."""
    return 2 * cap * words + CONTROL_WORDS
