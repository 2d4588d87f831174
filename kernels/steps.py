"""The gather's protocol steps as device functions; ``Gather.kernel`` composes them.

A *fragment* is 16 bytes (``WORDS`` int32 words) of one row of one rank's shard; it
is published, polled, copied and re-armed as a whole. Offsets are bytes from the
start of a parity box (or of the output: both are ``[rows, width]`` words).

Invariants every step keeps:

- ``push``: this rank's own fragments go, scrubbed, to the output and never through
  its own box; the peers' copies go with system-scope stores, and not at all once
  the fail-stop mark is seen (the call is void; ``reset`` re-arms every box).
- staged variant (``push_staged``, ``fetch_staged``, ``repoll_staged``,
  ``give_up_staged``): the same steps, with a batch's first read copied into the
  thread's own shared-memory slots (``slot``) instead of registers; a slot is
  rewritten only after the thread read it. Its dirty fragments are then polled one
  at a time with the volatile load (``repoll_staged``: one fragment's registers, no
  slot). Fragments are located again from their index (``locate``) rather than held.
- ``fetch``/``repoll``/``fetch_staged``: all of a batch's loads are issued before the
  first check; only dirty fragments are polled again.
- ``deliver`` (and the staged steps, all through ``take``): the reader re-arms what
  it copied; nobody else re-arms a box.
- ``give_up``: a fragment that never arrived is written as NaN, never left as what
  the allocator had; its rank joins the thread's ``missing`` mask.
- ``mark_peers``: a rank whose own wait ran out names the missing ranks in every
  rank's control block, fences, then raises every rank's mark, so every rank's next
  kernel stops at once; ``publish``: details, then ``fence_sys``, then the flag.
- ``epoch_of``/``advance``: every CTA reads the epoch before any CTA of the launch
  can advance it; only the launch's last CTA advances it, once.
- ``record_and_stop`` (serving only): the record, a fence, the flag, a fence, an
  eighth of the budget, then ``trap``; only the launch's last CTA, after every CTA
  delivered and marked.
- serving's steps (``serving``, a run-time Int32, uniform across the grid: nonzero
  is serving) run only behind it: the host record's missing ranks in ``mark_peers``
  and ``record_and_stop`` behind a branch on it; the heartbeats behind each thread's
  ``slow`` flag, which a launch that is not serving starts at 1 ("raised": nothing
  left to raise), so the loops test no second flag. A launch with 0 writes none of
  them and never traps.

The memory model's orderings, each by one fence (the PTX audit asserts each's place):

- re-arm before the next push: NO fence, by measurement. A rank's re-arms of parity p
  (call s, weak stores into its own box) must land before any peer's push into p in
  call s + 2. They are ordered by the kernel boundary: PDL's wait (or stream order)
  releases call s + 1 only once call s has completed with its memory operations
  performed; the re-arms target this GPU's own memory, whose L2 is the point of
  coherence every peer's remote store into it passes; and a peer's push into p in
  call s + 2 is causally after its poll saw this rank's push of call s + 1, issued after
  the wait. The PTX model has no kernel boundaries, so it cannot state this; a
  ``fence.acq_rel.sys`` after PDL's wait would, and costs the critical path a system
  fence's latency: on the H200 (emulated, default plan, µs per step, same run) TP 8
  M = 1 7.31 -> 10.62 (10.52 with one fence per CTA behind a barrier), TP 2 M = 1
  4.09 -> 5.70 (5.69), M = 64 within 3 %. Were the order ever broken, the word would
  read as armed: the poll waits, the call gives up (fail-stop), never wrong data.
- the last-CTA count (``advance``): ``bar.sync``, then thread 0's
  ``fence.acq_rel.gpu`` (release: every thread of the CTA's marks, missing ranks,
  slow word, and its epoch read, before the count), ``atom.add``, and in the CTA
  that completes the count a second ``fence.acq_rel.gpu`` (acquire) before it reads
  anything: the last CTA sees every other CTA's mark (a launch that gave up is never
  taken for a clean one) and no CTA's epoch read can see the advanced epoch.
- a mark before what it announces (``write_record``, ``fence.acq_rel.sys`` first):
  the mark was read (by the caller) before the missing-rank words; the marking rank
  stored those, ``fence.sc.sys``, then raised the mark (``mark_peers``).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from .primitives import (armed, atomic_add_word, atomic_max_word_sys, copy_async, fence_acq_rel_gpu,
                         fence_acq_rel_sys, fence_sys, load, load_address, load_shared, load_volatile,
                         load_word_volatile, opaque, scrub, store, store_sys, store_word, store_word_sys,
                         trap, wait_async)
from .protocol import (CONTROL_DONE, CONTROL_EPOCH, CONTROL_MARK, CONTROL_MISSING, CONTROL_SLOW,
                       EPOCH_SPAN, MARK_TOP, NAN_PAIR, PEER_CONTROL, SENTINEL, STATUS_EPOCH, STATUS_FLAG,
                       STATUS_PEERS, STATUS_SLOW, SLOW_SHIFT, STOP_SHIFT,
                       WORDS)

CAUSE_TIMEOUT, CAUSE_MARK = 1, 2  # why a thread stopped waiting


@cute.jit
def mark_of(control: Int64) -> Int32:
    """This rank's fail-stop mark: 0, or ``MARK_TOP`` minus the epoch that failed."""
    return Int32(load_word_volatile(control + CONTROL_MARK * 4))


@cute.jit
def epoch_of(control: Int64) -> Int32:
    """This rank's launch count; its low bit is this call's parity."""
    return Int32(load_word_volatile(control + CONTROL_EPOCH * 4))


@cute.jit
def advance(control: Int64, epoch: Int32, grid: Int32, tid: Int32, status: Int64,
            budget: Int64, start: Int64, slow: Int32, serving: Int32, tp: cutlass.Constexpr):
    """The last CTA to finish moves the epoch on (modulo ``EPOCH_SPAN``). Every thread
    read ``epoch`` before its CTA reached the barrier, so no CTA of this launch can see
    the new value. Launched ``serving``, the last CTA of a launch that finds the
    mark set (it gave up, began marked, or a peer gave up meanwhile) stops the
    context instead (``record_and_stop``): every CTA has delivered by then, so every
    thread's missing ranks are in the control block.

    The textbook last-block pattern (invariant: whatever a CTA wrote or read before
    its arrival happens before whatever the last CTA reads or writes after the
    count): ``bar.sync`` gathers the CTA's threads' writes into thread 0's view (CTA
    scope, cumulative), thread 0 releases them at GPU scope (``fence.acq_rel.gpu``)
    before its ``atom.add``, and the CTA whose add completes the count acquires with
    a second ``fence.acq_rel.gpu`` before its first read. Without the pair the model
    lets the last CTA read "no mark" after another CTA of the launch gave up (a
    serving step with NaN columns would finish normally), and lets an epoch read of
    some CTA see the advanced epoch (load buffering).

    Serving: thread 0 raises the slow heartbeat (``heartbeat``; ``slow`` is 1 from the
    start unless serving) before the release fence when the launch is already past half the budget (the fence waits for the
    CTA's stores, a push into a dead peer's memory among them)."""
    cute.arch.sync_threads()
    if tid == 0:
        heartbeat(start, budget, slow, status, control, epoch)  # before the fence
        fence_acq_rel_gpu()  # release: this CTA's marks, missing ranks, slow word, epoch read
        if atomic_add_word(control + CONTROL_DONE * 4, 1) == Uint32(grid - 1):
            fence_acq_rel_gpu()  # acquire: every other CTA's, before any read here
            if serving != 0:
                if mark_of(control) != 0:
                    record_and_stop(status, control, budget, epoch, tp)
                if load_word_volatile(control + CONTROL_SLOW * 4) != Uint32(0):
                    # slow but finished in time: the host's heartbeat goes down
                    store_word_sys(status + STATUS_SLOW * 4, 0)
                    store_word(control + CONTROL_SLOW * 4, 0)
            store_word(control + CONTROL_DONE * 4, 0)
            store_word(control + CONTROL_EPOCH * 4, (epoch + 1) & Int32(EPOCH_SPAN - 1))


@cute.jit
def heartbeat(start: Int64, budget: Int64, slow: Int32, status: Int64, own_control: Int64,
              epoch: Int32) -> Int32:
    """Serving: ``raise_slow`` once this thread is past half the budget (``start``: the
    launch's clock, taken after PDL's wait), unless it already did or the launch is
    not serving (``slow``, then 1 from the start: no timer read, no store); the
    new ``slow``. Called before each step that can stall (a push batch, the give-up's
    stores, the last-CTA fences) and after each poll that left fragments dirty."""
    if slow == 0:
        if cute.arch.globaltimer() - start > (budget >> SLOW_SHIFT):
            slow = raise_slow(status, own_control, epoch)
    return slow


@cute.jit
def raise_slow(status: Int64, own_control: Int64, epoch: Int32) -> Int32:
    """Serving's heartbeat of a launch still waiting at half the budget (``protocol``):
    ``STATUS_SLOW`` = epoch + 1 in host memory, ``CONTROL_SLOW`` in this rank's control
    block (so the last CTA clears both if the launch finishes in time). Returns 1, the
    thread's "raised" flag, so it writes once."""
    store_word(own_control + CONTROL_SLOW * 4, 1)
    store_word_sys(status + STATUS_SLOW * 4, epoch + 1)
    # No fence: ``advance``'s release before the CTA count orders both before the last
    # CTA's read and clear (a fence here would be one more place to stall).
    return Int32(1)


@cute.jit
def record_and_stop(status: Int64, own_control: Int64, budget: Int64, epoch: Int32,
                    tp: cutlass.Constexpr):
    """Serving's give-up: the failed epoch and the missing ranks (from the mark's
    control block) into the status record, a fence, the flag, then ``trap``
    ``budget >> STOP_SHIFT`` later: peers giving up at the same moment finish marking
    this rank's mailbox before its context dies. The record is out before the
    context dies, so the host can name the ranks (and its watcher knows when the
    trap is due).

    First, whatever the time, the slow heartbeat of this call (``STATUS_SLOW`` =
    ``epoch`` + 1; no fence): the record's fences can stall (a peer's memory that no
    longer answers), and then the heartbeat, with no flag, is what the host's
    watchdog sees; when they do not, the flag follows and wins (the host reads it
    first)."""
    store_word_sys(status + STATUS_SLOW * 4, epoch + 1)
    write_record(status, own_control, Int32(MARK_TOP) - mark_of(own_control), tp)
    fence_sys()
    due = cute.arch.globaltimer() + (budget >> STOP_SHIFT)
    while cute.arch.globaltimer() < due:
        pass
    trap()


@cute.jit
def push(src: Int64, dst: Int64, targets: cute.Tensor, column: Int64, rows: Int32,
         first: Int32, stride: Int32, stop: Int32, watch, tp: cutlass.Constexpr,
         frags: cutlass.Constexpr, width: cutlass.Constexpr,
         unroll: cutlass.Constexpr) -> Int32:
    """This rank's fragments (``first``, ``first + stride``, ...) to the output and,
    unless ``stop``, into row m of every peer's box (``targets[1:]``); before each
    batch after the first, ``heartbeat`` (``watch``: its arguments; its flag ``slow``
    starts at 1 unless serving); returns the flag."""
    pushes = rows * frags
    base = first
    slow = watch[2]
    while base < pushes:
        if base != first:  # before this batch's stores: a store can stall
            slow = heartbeat(watch[0], watch[1], slow, watch[3], watch[4], watch[5])
        held = cute.make_rmem_tensor((unroll, WORDS), Uint32)
        for i in cutlass.range_constexpr(unroll):  # every load before any store
            f = base + i * stride
            if f < pushes:
                words = load(src + Int64(f) * 16)
                for k in cutlass.range_constexpr(WORDS):
                    held[i, k] = words[k]
        for i in cutlass.range_constexpr(unroll):
            f = base + i * stride
            if f < pushes:
                offset = push_offset(f, column, frags, width)
                push_fragment(tuple(held[i, k] for k in range(WORDS)), offset, dst, targets,
                              stop, tp)
        base = base + stride * unroll
    return slow


@cute.jit
def push_offset(f: Int32, column: Int64, frags: cutlass.Constexpr,
                width: cutlass.Constexpr) -> Int64:
    """The byte offset of this rank's fragment ``f`` in a box row (and the output's):
    row m, this rank's ``column`` (in words) onwards."""
    m = f // frags
    return (Int64(m) * width + column + Int64(f - m * frags) * WORDS) * 4


@cute.jit
def push_fragment(words, offset: Int64, dst: Int64, targets: cute.Tensor, stop: Int32,
                  tp: cutlass.Constexpr):
    """A fragment of this rank's (``words``), scrubbed, at ``offset`` of every peer's
    box (unless ``stop``) and of the output: ``push``'s stores, staged or not."""
    clean = tuple(scrub(words[k]) for k in range(WORDS))
    if stop == 0:
        for step in cutlass.range_constexpr(1, tp):
            store_sys(targets[step] + offset, clean)
    store(dst + offset, clean)  # every rank's output holds the same bits


@cute.jit
def locate(f: Int32, rank: Int32, frags: cutlass.Constexpr, width: cutlass.Constexpr):
    """Peer fragment ``f`` of this rank's box: its byte offset (box and output alike)
    and the rank that pushes it. Row-major over the row's peer fragments, our own
    columns skipped."""
    others: cutlass.Constexpr = width // WORDS - frags  # peer fragments per row
    m = f // others
    j = f - m * others
    j = j + frags * Int32(j >= rank * frags)
    source = j // frags
    return (Int64(m) * width + Int64(j) * WORDS) * 4, source


@cute.jit
def fetch(own: Int64, held: cute.Tensor, where: cute.Tensor, source: cute.Tensor,
          base: Int32, stride: Int32, polls: Int32, rank: Int32, frags: cutlass.Constexpr,
          width: cutlass.Constexpr, unroll: cutlass.Constexpr) -> Int32:
    """Load a batch of peer fragments from this rank's box; the dirty ones' mask."""
    pending = Int32(0)
    for i in cutlass.range_constexpr(unroll):
        f = base + i * stride
        where[i] = Int64(0)
        source[i] = Int32(0)
        if f < polls:
            where[i], source[i] = locate(f, rank, frags, width)
            words = load_volatile(own + where[i])
            for k in cutlass.range_constexpr(WORDS):
                held[i, k] = words[k]
            if armed(words) != 0:
                pending = pending | (1 << i)
    return pending


@cute.jit
def repoll(own: Int64, held: cute.Tensor, where: cute.Tensor, pending: Int32,
           unroll: cutlass.Constexpr) -> Int32:
    """Poll the dirty fragments of a batch once more; the mask still dirty."""
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            words = load_volatile(own + where[i])
            for k in cutlass.range_constexpr(WORDS):
                held[i, k] = words[k]
            if armed(words) == 0:
                pending = pending & ~(1 << i)
    return pending


@cute.jit
def deliver(own: Int64, dst: Int64, held: cute.Tensor, where: cute.Tensor, source: cute.Tensor,
            pending: Int32, missing: Int32, base: Int32, stride: Int32, polls: Int32,
            unroll: cutlass.Constexpr) -> Int32:
    """Copy a batch's arrived fragments out and re-arm them; write the rest as NaN
    (``give_up``). Returns ``missing`` with those fragments' ranks added."""
    for i in cutlass.range_constexpr(unroll):
        if base + i * stride < polls:
            if (pending >> i) & 1:
                store(dst + where[i], (Uint32(NAN_PAIR),) * WORDS)  # give_up
                missing = missing | (1 << source[i])
            else:
                take(own, dst, where[i], tuple(held[i, k] for k in range(WORDS)))
    return missing


@cute.jit
def take(own: Int64, dst: Int64, where: Int64, words):
    """An arrived fragment (``words``, at byte ``where`` of the box and the output):
    copied out, then its box slot re-armed. Every path that delivers goes through
    here: the reader re-arms what it copied, and nobody else re-arms a box."""
    store(dst + where, words)
    store(own + where, (Uint32(SENTINEL),) * WORDS)


@cute.jit
def slot(stage: Int32, i: cutlass.Constexpr, tid: Int32, threads: cutlass.Constexpr) -> Int32:
    """The shared address of this thread's slot ``i`` of a batch: ``[unroll][threads]``
    fragments, so a warp's slots are consecutive (no bank conflicts)."""
    return stage + (Int32(i * threads) + tid) * 16


@cute.jit
def push_staged(src: Int64, dst: Int64, targets: cute.Tensor, column: Int64, rows: Int32,
                first: Int32, stride: Int32, stop: Int32, watch, stage: Int32, tid: Int32,
                threads: cutlass.Constexpr, tp: cutlass.Constexpr, frags: cutlass.Constexpr,
                width: cutlass.Constexpr, unroll: cutlass.Constexpr) -> Int32:
    """``push``, the batch's shard fragments staged through shared memory."""
    pushes = rows * frags
    base = first
    slow = watch[2]
    while base < pushes:
        if base != first:  # before this batch's stores: a store can stall
            slow = heartbeat(watch[0], watch[1], slow, watch[3], watch[4], watch[5])
        for i in cutlass.range_constexpr(unroll):  # every copy before any store
            f = base + i * stride
            if f < pushes:
                copy_async(slot(stage, i, tid, threads), src + Int64(f) * 16)
        wait_async()
        again = opaque(base)  # the offsets again, not held across the wait
        for i in cutlass.range_constexpr(unroll):
            f = again + i * stride
            if f < pushes:
                offset = push_offset(f, column, frags, width)
                push_fragment(load_shared(slot(stage, i, tid, threads)), offset, dst, targets,
                              stop, tp)
        base = base + stride * unroll
    return slow


@cute.jit
def fetch_staged(own: Int64, dst: Int64, pending: Int32, base: Int32, stride: Int32,
                 polls: Int32, rank: Int32, stage: Int32, tid: Int32,
                 threads: cutlass.Constexpr, frags: cutlass.Constexpr,
                 width: cutlass.Constexpr, unroll: cutlass.Constexpr) -> Int32:
    """Copy the ``pending`` fragments of a batch into their slots, then deliver each
    that arrived (copy out, re-arm); the mask of those still dirty."""
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            where, _ = locate(base + i * stride, rank, frags, width)
            copy_async(slot(stage, i, tid, threads), own + where)
    wait_async()
    again = opaque(base)  # the offsets again, not held across the wait
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            words = load_shared(slot(stage, i, tid, threads))
            if armed(words) == 0:
                where, _ = locate(again + i * stride, rank, frags, width)
                take(own, dst, where, words)
                pending = pending & ~(1 << i)
    return pending


@cute.jit
def repoll_staged(own: Int64, dst: Int64, pending: Int32, base: Int32, stride: Int32,
                  rank: Int32, frags: cutlass.Constexpr, width: cutlass.Constexpr,
                  unroll: cutlass.Constexpr) -> Int32:
    """Poll a staged batch's dirty fragments once more, one at a time with the volatile
    load (its progress is the memory model's, unlike ``cp.async``'s), delivering each
    that arrived; the mask still dirty. One fragment's registers at a time, so a pass
    is up to ``unroll`` dependent loads: measured on one H200 (emulated TP 8, M = 16
    and 64; TP 2, M = 64) within the run-to-run spread of re-polling with
    ``cp.async`` (CHANGELOG.md, 0.3.4)."""
    again = opaque(base)  # the offsets computed here, not held through the wait loop
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            where, _ = locate(again + i * stride, rank, frags, width)
            words = load_volatile(own + where)
            if armed(words) == 0:
                take(own, dst, where, words)
                pending = pending & ~(1 << i)
    return pending


@cute.jit
def batch_of(base: Int32, stride: Int32, polls: Int32, unroll: cutlass.Constexpr) -> Int32:
    """The mask of a batch's fragments that exist (the last batch may be short)."""
    mask = Int32(0)
    for i in cutlass.range_constexpr(unroll):
        if base + i * stride < polls:
            mask = mask | (1 << i)
    return mask


@cute.jit
def give_up_staged(dst: Int64, pending: Int32, missing: Int32, base: Int32, stride: Int32,
                   rank: Int32, frags: cutlass.Constexpr, width: cutlass.Constexpr,
                   unroll: cutlass.Constexpr) -> Int32:
    """``give_up`` for a staged batch: NaN for every fragment still ``pending``;
    ``missing`` with their ranks added."""
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            where, source = locate(base + i * stride, rank, frags, width)
            store(dst + where, (Uint32(NAN_PAIR),) * WORDS)
            missing = missing | (1 << source)
    return missing


@cute.jit
def mark_peers(peers: Int64, missing: Int32, epoch: Int32, status: Int64, serving: Int32,
               tp: cutlass.Constexpr):
    """After this rank's own wait ran out in call ``epoch``: name the ``missing``
    ranks in every rank's control block, fence, then raise every rank's mark. The
    control blocks' addresses are read from the peer table here, on this rare path,
    not held in registers through the poll loop (they cost a CTA per SM at TP 8).

    Serving: first the same ranks into this rank's host record (``STATUS_PEERS``,
    no flag, no fence: every writer writes 1, as the record does), so a launch that
    stalls in the stores below (into a peer whose memory no longer answers) has told
    the host which ranks it found missing. The thread raised the heartbeat already:
    its wait ran past three quarters of the budget (``Gather.still_waiting``)."""
    if serving != 0:
        for p in cutlass.range_constexpr(tp):
            if (missing >> p) & 1:
                store_word_sys(status + (STATUS_PEERS + p) * 4, 1)
    for q in cutlass.range_constexpr(tp):
        control = load_address(peers + Int64(PEER_CONTROL * tp + q) * 8)
        for p in cutlass.range_constexpr(tp):
            if (missing >> p) & 1:
                store_word_sys(control + (CONTROL_MISSING + p) * 4, 1)
    fence_sys()
    for q in cutlass.range_constexpr(tp):
        control = load_address(peers + Int64(PEER_CONTROL * tp + q) * 8)
        atomic_max_word_sys(control + CONTROL_MARK * 4, Int32(MARK_TOP) - epoch)


@cute.jit
def publish(status: Int64, own_control: Int64, epoch: Int32, tp: cutlass.Constexpr):
    """A call after the failed one raises the host flag: the failed epoch and the
    missing ranks (copied from the mark's block), a fence, then the flag. The failed
    call itself does not (see ``protocol``: every rank's flag comes from call s + 1)."""
    mark = mark_of(own_control)
    if mark != 0:
        failed = Int32(MARK_TOP) - mark
        behind = (epoch - failed) & Int32(EPOCH_SPAN - 1)  # calls since the failed one
        if behind != 0:
            if behind < Int32(EPOCH_SPAN // 2):
                write_record(status, own_control, failed, tp)  # fences after the mark's read


@cute.jit
def write_record(status: Int64, own_control: Int64, failed: Int32, tp: cutlass.Constexpr):
    """The host-visible record of a give-up: the missing ranks (copied from the
    mark's control block) and the failed epoch, a system-scope fence, then the flag,
    so a host that reads the flag reads the details.

    Every caller read the mark first (``failed`` comes from it). Invariant: the
    missing-rank words read here are at least those the mark announces: the marking
    rank stored them, fenced (``fence.sc.sys``) and then raised the mark
    (``mark_peers``), so this side's acquire, ``fence.acq_rel.sys`` between the
    mark's read and theirs, is the first thing here (one place for both callers,
    ``publish`` and ``record_and_stop``)."""
    fence_acq_rel_sys()  # acquire: the mark read before, what it announces after
    for p in cutlass.range_constexpr(tp):
        if load_word_volatile(own_control + (CONTROL_MISSING + p) * 4) != Uint32(0):
            store_word_sys(status + (STATUS_PEERS + p) * 4, 1)
    store_word_sys(status + STATUS_EPOCH * 4, failed)
    fence_sys()
    store_word_sys(status + STATUS_FLAG * 4, 1)


__all__ = ["heartbeat", "push_staged", "fetch_staged", "repoll_staged", "batch_of", "give_up_staged", "locate", "slot", "take", "epoch_of", "advance", "mark_of", "push", "fetch", "repoll", "deliver", "mark_peers",
           "publish", "raise_slow", "record_and_stop", "write_record", "CAUSE_MARK", "CAUSE_TIMEOUT", "load_address"]
