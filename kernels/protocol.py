"""The mailbox protocol's constants, the one definition every layer imports; plain
Python (docs/design.md, "The mailbox", "The spin budget and the two modes"). Invariants:
- A rank's mailbox, int32 words: ``[parity 0: cap x W][parity 1: cap x W][control]``,
  ``W = V / 2``; box words start armed (``SENTINEL``), control words at 0 and only
  ``reset`` clears them. Parity 1 lies the same distance after parity 0 on every rank.
- Status record: the details, a system fence, then ``STATUS_FLAG``; every writer of
  a word writes the same value.
- Serving traps an eighth after its flag so that peers giving up at the same moment
  finish marking this rank: a rank marking a peer that had trapped hangs.
"""

SENTINEL = 0x80000000  # "not yet published": the BF16 pair (+0, -0), the FP32 -0.0
SENTINEL_I32 = SENTINEL - (1 << 32)
NAN_PAIR = 0x7FC07FC0  # what a fragment that never arrived is written as
WORDS = 4  # 32-bit words per 16-byte fragment
WORD_BYTES = 4
FRAGMENT_BYTES = WORD_BYTES * WORDS
FRAGMENT_BF16 = FRAGMENT_BYTES // 2

MAX_TP = 32
CONTROL_MARK, CONTROL_MISSING = 0, 1
MARK_TOP = 0x7FFFFFFF  # mark = MARK_TOP - failed epoch: the largest mark is the earliest call
# Launches count modulo EPOCH_SPAN: even, so the parity alternates across the wrap;
# below 2**31, so a mark is never 0 ("no mark") and never overflows.
EPOCH_SPAN = 1 << 30
# The ticket pair, one aligned 64-bit word: the running launch's tickets, then the epoch.
CONTROL_TICKETS = 2 * ((CONTROL_MISSING + MAX_TP + 1) // 2)
CONTROL_EPOCH = CONTROL_TICKETS + 1
CONTROL_DONE = CONTROL_EPOCH + 1
CONTROL_WORDS = 4 * ((CONTROL_DONE + 2 + 3) // 4)  # whole fragments: the boxes stay aligned
PEER_PARITY0, PEER_PARITY1, PEER_CONTROL = 0, 1, 2
PEER_ROWS = 3

STATUS_FLAG, STATUS_EPOCH, STATUS_PEERS = 0, 1, 2
STATUS_SLOW = STATUS_PEERS + MAX_TP  # serving: epoch + 1 of a launch waiting past 1/2
STATUS_WORDS = STATUS_SLOW + 1

# Serving's slow heartbeat at 1/2 of the budget, give-up at 3/4, trap at 7/8.
SLOW_SHIFT, GIVE_UP_SHIFT, STOP_SHIFT = 1, 2, 3
# A wait reads the mark only after MARK_AFTER_NS: the mark only ends a wait early, so a
# normal call's spin costs one round trip and no poller loads the line a marker writes.
MARK_AFTER_NS = 1 << 16


def slow_after(budget):
    return budget / (1 << SLOW_SHIFT)


def give_up_after(budget):
    return budget - budget / (1 << GIVE_UP_SHIFT)


def trap_grace(budget):
    return budget / (1 << STOP_SHIFT)


def trap_after(budget):
    return give_up_after(budget) + trap_grace(budget)

# Diagnostics (``timers``): per CTA and call, ns stamps of each phase after the record.
TIMER_PHASES = ("entry", "waited", "pushed", "delivered", "done")
TIMER_BASE = (STATUS_WORDS + 1) // 2  # in int64: the record's int32 words, rounded up
TIMER_CALLS = 64


def timer_index(epoch: int, cta: int, ctas: int, phase: int) -> int:
    return TIMER_BASE + ((epoch % TIMER_CALLS) * ctas + cta) * len(TIMER_PHASES) + phase


def timer_words(ctas: int) -> int:
    """int32 words of a diagnostic status buffer: the record, then every call's stamps."""
    return 2 * (TIMER_BASE + TIMER_CALLS * ctas * len(TIMER_PHASES))

THREADS = (64, 128, 256, 512, 1024)
UNROLL_MAX = 16  # fragments in flight per thread, at most
DEFAULT_THREADS, DEFAULT_UNROLL = 256, 4
# Batches of this many fragments per thread or more go through shared memory
# (``cp.async``, "staged"): in registers they would halve the CTAs per SM.
STAGED_FROM = 8
SHARED_CONTROL_BYTES = 16  # the CTA's epoch word, padded to a fragment


def staged(unroll: int) -> bool:
    return unroll >= STAGED_FROM


def staged_bytes(threads: int, unroll: int) -> int:
    return threads * unroll * 4 * WORDS


def shared_bytes(threads: int, unroll: int, staged: bool) -> int:
    return SHARED_CONTROL_BYTES + (staged_bytes(threads, unroll) if staged else 0)


def box_words(cap: int, words: int) -> int:
    return 2 * cap * words + CONTROL_WORDS
