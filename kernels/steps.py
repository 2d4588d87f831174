"""The gather's protocol steps as device functions; ``Gather.kernel`` composes them
(docs/design.md, the protocol: "One call, step by step").

A *fragment* is 16 bytes (``WORDS`` int32 words) of one row of one rank's shard; it
is published, polled, copied and re-armed whole. Offsets are bytes from the start of
a parity box (or of the output: both are ``[rows, width]`` words).

Invariants a change must keep:

- ``push``: own fragments go scrubbed to the output, never through the own box; to
  peers by system-scope stores, and not at all once the mark is seen. All-to-all:
  ``push_token`` too, to each peer of 0 rows this call, which polls the tokens as
  fragments and writes none of them out (``write_out``).
- The reader re-arms what it copied, only through ``take``; nobody else re-arms.
- A fragment that never arrived is written as NaN; its rank joins ``missing``.
- A batch's loads are all issued before the first check: predicated loads
  (``primitives.poll``, ``load_if``), no branch between them, so a poll, a spin and
  a push's first loads each cost one round trip (the PTX audit pins it). Only dirty
  fragments are polled again; the mark is read with them once a wait is late
  (``protocol.MARK_AFTER_NS``), and in the push after the first batch's loads.
  Staged: a slot is rewritten only after its thread read it; repolls use the
  volatile load (``cp.async`` is weak).
- A CTA's epoch is its ticket (``take_epoch``: one atomic add to the ticket pair);
  only the launch's last ticket moves the epoch on, once every CTA holds it.
- Serving-only steps sit behind ``serving`` (uniform across the grid) or a thread's
  ``slow`` flag (1 from the start unless serving): a launch with 0 writes none of
  them and never traps.

Fences (the PTX audit, tests/test_kernels_ptx.py, checks each place):

- re-arm before the same parity's next push: none; the kernel boundary orders it
  (docs/design.md, "Parities and re-arm"; a fence's cost: docs/figures.md). Broken,
  a poll times out and the call fail-stops: never wrong data.
- the epoch: none; the ticket is one atomic read of the pair, and the next launch
  takes its tickets after this one's CTAs each took theirs and its last moved the
  pair (before their ``launch_dependents``, or its end in stream order): a premise of
  the hardware, docs/design.md.
- the done count (``finish``): a CTA that reports (a thread stopped waiting, or
  raised the heartbeat) releases ``fence.acq_rel.gpu`` before its count; one that
  takes the heartbeat down acquires ``fence.acq_rel.gpu`` after every CTA's count,
  before the mark's read. A CTA with nothing to report counts with a ``red`` and
  leaves.
- a mark before what it announces: the marker stores the missing ranks,
  ``fence.sc.sys``, then the mark (``mark_peers``); a reader of the mark fences
  ``fence.acq_rel.sys`` before reading them (``write_record``).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from .primitives import (armed, atomic_max_word_sys, await_word, copy_async, count_word, fence_acq_rel_gpu,
                         fence_acq_rel_sys, fence_sys, grid_size, load_if, load_address, load_shared, load_volatile,
                         load_word_volatile, load_word_volatile_if, opaque, poll, scrub, store, store_sys,
                         store_word_sys, take_ticket, trap, wait_async)
from .protocol import (CONTROL_DONE, CONTROL_MARK, CONTROL_MISSING, CONTROL_TICKETS,
                       EPOCH_SPAN, MARK_TOP, NAN_PAIR, PEER_CONTROL, PEER_PARITY0, SENTINEL, STATUS_EPOCH, STATUS_FLAG,
                       STATUS_PEERS, STATUS_SLOW, SLOW_SHIFT, STOP_SHIFT,
                       WORDS)

CAUSE_TIMEOUT, CAUSE_MARK = 1, 2  # why a thread stopped waiting


@cute.jit
def mark_of(control: Int64) -> Int32:
    """This rank's fail-stop mark: 0, or ``MARK_TOP`` minus the epoch that failed."""
    return Int32(load_word_volatile(control + CONTROL_MARK * 4))


@cute.jit
def late_mark(control: Int64, late: Int32) -> Int32:
    """``mark_of`` once a wait is ``late`` (``protocol.MARK_AFTER_NS``), else 0 with no
    load: one predicated load, issued beside a batch's polls."""
    return Int32(load_word_volatile_if(control + CONTROL_MARK * 4, late))


# What a CTA's threads report at the end (``finish``; ``primitives.barrier_any``)
REPORT_CAUSE, REPORT_SLOW = 1, 2  # a thread stopped waiting; it raised serving's heartbeat


@cute.jit
def take_epoch(control: Int64):
    """Thread 0 of each CTA, before PDL's wait: ``(epoch, last)``, this launch's epoch from
    one atomic add to the ticket pair (``CONTROL_TICKETS``, ``CONTROL_EPOCH``), and 1
    in the CTA that took the launch's last ticket (all but one taken before it). That
    CTA moves the pair to (0, the next epoch modulo ``EPOCH_SPAN``) with an atomic add
    it waits for, before it lets the next launch start: every CTA of this launch has
    read the epoch by then (the pair is one word), and the next launch's tickets come
    after this one's ``launch_dependents`` (PDL) or its end (stream order). No fence:
    the atomics are the reads and the move, at the device's point of coherence. The
    caller clears the next launch's done count after PDL's wait."""
    taken, epoch = take_ticket(control + CONTROL_TICKETS * 4, Int64(1))
    last = Int32(0)
    if taken == Uint32(grid_size() - 1):
        # (grid, epoch) -> (0, epoch + 1): add 2^32 - grid; at the span's end, wrap
        moved, _ = take_ticket(control + CONTROL_TICKETS * 4, Int64(1 << 32) - Int64(taken) - 1)
        if epoch == Uint32(EPOCH_SPAN - 1):
            moved, _ = take_ticket(control + CONTROL_TICKETS * 4, Int64(-(EPOCH_SPAN << 32)))
        last = Int32(moved == taken + 1) | Int32(moved == 0)  # 1: read, so waited for
    return Int32(epoch), last


@cute.jit
def finish(control: Int64, epoch: Int32, reported: Int32, status: Int64,
           budget: Int64, start: Int64, slow: Int32, serving: Int32, tp: cutlass.Constexpr):
    """Thread 0 of each CTA, after the CTA's barrier: counts the CTA done
    (``CONTROL_DONE`` + parity) and acts on what its threads ``reported``
    (``REPORT_CAUSE``, ``REPORT_SLOW``). A CTA with nothing to report counts and
    leaves: no fence, no wait. One that reports releases first (its marks and missing
    ranks); served, a CTA that stopped waiting records and traps (``record_and_stop``);
    one whose heartbeat went up waits for every CTA's count (one budget at most),
    then acquires and, if no mark is set, takes the host's heartbeat down (the launch
    finished in time). ``slow``: thread 0's flag; its own ``heartbeat`` comes first,
    since a store of the CTA's may stall."""
    if heartbeat(start, budget, slow, status, control, epoch) != slow:
        reported = reported | REPORT_SLOW
    done = control + (CONTROL_DONE + (epoch & 1)) * 4
    if reported != 0:
        fence_acq_rel_gpu()  # release: this CTA's marks, missing ranks and heartbeat
    count_word(done)
    if reported != 0:
        if (serving != 0) & ((reported & REPORT_CAUSE) != 0):
            record_and_stop(status, control, budget, epoch, tp)
        if (reported & REPORT_SLOW) != 0:
            if await_word(done, grid_size(), budget) != 0:
                fence_acq_rel_gpu()  # acquire: every CTA's marks before the mark's read
                if mark_of(control) == 0:
                    store_word_sys(status + STATUS_SLOW * 4, 0)


@cute.jit
def heartbeat(start: Int64, budget: Int64, slow: Int32, status: Int64, own_control: Int64,
              epoch: Int32) -> Int32:
    """Serving: ``raise_slow`` once this thread is past half the budget (``start``: taken
    after PDL's wait), unless ``slow`` is already 1 (raised, or not serving: no timer
    read, no store); returns the new ``slow``. Called before each step that can stall
    and after each poll that left fragments dirty."""
    if slow == 0:
        if cute.arch.globaltimer() - start > (budget >> SLOW_SHIFT):
            slow = raise_slow(status, own_control, epoch)
    return slow


@cute.jit
def raise_slow(status: Int64, own_control: Int64, epoch: Int32) -> Int32:
    """Serving's heartbeat of a launch still waiting at half the budget (``protocol``):
    ``STATUS_SLOW`` = epoch + 1 in host memory. Returns 1, the thread's "raised" flag,
    so it writes once; the CTA reports it (``REPORT_SLOW``) and ``finish`` takes it down
    if the launch ends in time."""
    store_word_sys(status + STATUS_SLOW * 4, epoch + 1)
    return Int32(1)


@cute.jit
def record_and_stop(status: Int64, own_control: Int64, budget: Int64, epoch: Int32,
                    tp: cutlass.Constexpr):
    """Serving's give-up: the slow heartbeat first (no fence: if the record's fences stall,
    it is what the host's watchdog sees), then the record (``write_record``: missing
    ranks, failed epoch, fence, flag), then ``trap`` ``budget >> STOP_SHIFT`` later, so
    peers giving up at the same moment finish marking this rank's mailbox first."""
    store_word_sys(status + STATUS_SLOW * 4, epoch + 1)
    write_record(status, own_control, Int32(MARK_TOP) - mark_of(own_control), tp)
    fence_sys()
    due = cute.arch.globaltimer() + (budget >> STOP_SHIFT)
    while cute.arch.globaltimer() < due:
        pass
    trap()


@cute.jit
def push(src: Int64, dst: Int64, targets: cute.Tensor, column: Int64, rows: Int32,
         first: Int32, stride: Int32, mark: Int32, watch, tp: cutlass.Constexpr,
         frags: cutlass.Constexpr, width: cutlass.Constexpr,
         unroll: cutlass.Constexpr, routing=None, control=None):
    """This rank's fragments (``first``, ``first + stride``, ...) to the output and,
    unless the call begins marked, into row m of every peer's box (``targets[1:]``);
    before each batch after the first, ``heartbeat`` (``watch``: its arguments; its
    flag ``slow`` starts at 1 unless serving). Returns ``(slow, mark)``: the mark
    (``mark_of``) is ``mark`` as given, or, with ``control``, read once here after the
    first batch's loads are issued (or at once, with no batch), so the two round trips
    overlap. All-to-all (``routing``: the rank and its tp + 1 row offsets): each
    fragment to its one destination instead (``route``, ``send_fragment``)."""
    pushes = rows * frags
    base = first
    slow = watch[2]
    if cutlass.const_expr(control is not None):
        if first >= pushes:
            mark = mark_of(control)
    while base < pushes:
        if base != first:  # before this batch's stores: a store can stall
            slow = heartbeat(watch[0], watch[1], slow, watch[3], watch[4], watch[5])
        held = cute.make_rmem_tensor((unroll, WORDS), Uint32)
        for i in cutlass.range_constexpr(unroll):  # every load before any store, no branch
            f = base + i * stride  # i = 0: in the loop, always a fragment
            words = load_if(src + Int64(f) * 16, Int32(f < pushes) if i else Int32(1))
            for k in cutlass.range_constexpr(WORDS):
                held[i, k] = words[k]
        if cutlass.const_expr(control is not None):
            if base == first:
                mark = mark_of(control)
        again = opaque(base)  # the offsets computed after the mark's read, not held through it
        for i in cutlass.range_constexpr(unroll):
            f = again + i * stride
            if (f < pushes) | (i == 0):
                if cutlass.const_expr(routing is None):
                    offset = push_offset(f, column, frags, width)
                    push_fragment(tuple(held[i, k] for k in range(WORDS)), offset, dst,
                                  targets, mark, tp)
                else:
                    offset, step, box = route(f, column, routing, targets, frags, width, tp)
                    send_fragment(tuple(held[i, k] for k in range(WORDS)), offset, dst, step,
                                  box, mark)
        base = base + stride * unroll
    return slow, mark


@cute.jit
def push_offset(f: Int32, column: Int64, frags: cutlass.Constexpr,
                width: cutlass.Constexpr) -> Int64:
    """The byte offset of this rank's fragment ``f`` in a box row (and the output's):
    row m, this rank's ``column`` (in words) onwards."""
    m = f // frags
    return (Int64(m) * width + column + Int64(f - m * frags) * WORDS) * 4


@cute.jit
def push_fragment(words, offset: Int64, dst: Int64, targets: cute.Tensor, mark: Int32,
                  tp: cutlass.Constexpr):
    """A fragment of this rank's (``words``), scrubbed, at ``offset`` of every peer's
    box (unless ``mark``: the call began marked) and of the output: ``push``'s stores,
    staged or not."""
    clean = tuple(scrub(words[k]) for k in range(WORDS))
    if mark == 0:
        for step in cutlass.range_constexpr(1, tp):
            store_sys(targets[step] + offset, clean)
    store(dst + offset, clean)  # every rank's output holds the same bits


@cute.jit
def route(f: Int32, column: Int64, routing, targets: cute.Tensor, frags: cutlass.Constexpr,
          width: cutlass.Constexpr, tp: cutlass.Constexpr):
    """All-to-all: where this rank's fragment ``f`` goes (``routing``: this rank and the
    tp + 1 row offsets). Row m of the shard belongs to rank q, the last with
    ``offsets[q] <= m`` (non-decreasing, so a rank of an empty split is never
    chosen), and lands in row ``m - offsets[q]`` of q's box, this rank's ``column``
    onwards (q == this rank: of the output). Returns that byte offset, q's distance
    in push order (0: this rank) and q's box of this parity (``targets[distance]``;
    unused at distance 0)."""
    rank, offsets = routing
    m = f // frags
    first = offsets[0]
    q = Int32(0)
    for p in cutlass.range_constexpr(1, tp):
        if offsets[p] <= m:
            q = Int32(p)
            first = offsets[p]
    offset = (Int64(m - first) * width + column + Int64(f - m * frags) * WORDS) * 4
    step = (q - rank + tp) % tp
    box = targets[0]
    for s in cutlass.range_constexpr(1, tp):
        if step == s:
            box = targets[s]
    return offset, step, box


@cute.jit
def send_fragment(words, offset: Int64, dst: Int64, step: Int32, box: Int64, mark: Int32):
    """All-to-all's ``push_fragment``: a fragment of this rank's (``words``), scrubbed,
    at ``offset`` of its one destination: this rank's output (``step`` 0) or, unless
    ``mark``, its rank's ``box`` by a system-scope store."""
    clean = tuple(scrub(words[k]) for k in range(WORDS))
    if step == 0:
        store(dst + offset, clean)
    else:
        if mark == 0:
            store_sys(box + offset, clean)


@cute.jit
def push_token(me: Int32, epoch: Int32, column: Int64, routing, peers: Int64, shift: Int64,
               stop: Int32, tp: cutlass.Constexpr):
    """All-to-all: a rank of 0 rows this call polls one token per peer, so its call
    waits on every peer's as the gather's does (no rank more than a call ahead).
    Thread q < tp pushes this rank's token to rank q when q's split is empty and q is
    not this rank, unless ``stop``: the epoch (below ``EPOCH_SPAN``: never the
    sentinel) in every word of one fragment, by a system-scope store, at row 0 of q's
    box of this parity (its address read from the peer table here, as ``mark_peers``
    does: fewer registers through the push; ``shift`` bytes on), this rank's ``column``
    onwards: the slot of this rank's first fragment for q, which no data fills in a
    call where q has no row, and which only q's token poll reads and re-arms."""
    rank, offsets = routing
    box = Int64(0)
    for q in cutlass.range_constexpr(tp):  # compile-time indices: no local memory
        if me == q:
            if (offsets[q + 1] == offsets[q]) & (rank != q) & (stop == 0):
                box = load_address(peers + Int64(PEER_PARITY0 * tp + q) * 8) + shift
    if box != 0:
        store_sys(box + column * 4, (Uint32(epoch),) * WORDS)


@cute.jit
def locate(f: Int32, rank: Int32, frags: cutlass.Constexpr, width: cutlass.Constexpr,
           token=None):
    """Peer fragment ``f`` of this rank's box: its byte offset (box and output alike)
    and the rank that pushes it. Row-major over the row's peer fragments, our own
    columns skipped. All-to-all, ``token`` 1 (this rank has 0 rows): the f-th peer's
    token instead, its first fragment of row 0 (``push_token``)."""
    others: cutlass.Constexpr = width // WORDS - frags  # peer fragments per row
    if cutlass.const_expr(token is not None):
        f = f * (Int32(1) + token * Int32(frags - 1))  # f < tp - 1: row 0, peer f's first
    m = f // others
    j = f - m * others
    j = j + frags * Int32(j >= rank * frags)
    source = j // frags
    return (Int64(m) * width + Int64(j) * WORDS) * 4, source


@cute.jit
def fetch(own: Int64, held: cute.Tensor, where: cute.Tensor, source: cute.Tensor,
          base: Int32, stride: Int32, polls: Int32, rank: Int32, frags: cutlass.Constexpr,
          width: cutlass.Constexpr, unroll: cutlass.Constexpr, token=None) -> Int32:
    """Load a batch of peer fragments (``token``: tokens, ``locate``) from this rank's
    box, every ``poll`` issued before the first check (no branch between them: a
    fragment past ``polls`` is a poll switched off); the dirty ones' mask."""
    exists = Int32(0)
    for i in cutlass.range_constexpr(unroll):
        f = base + i * stride
        on = Int32(f < polls)
        exists = exists | (on << i)
        where[i], source[i] = locate(f, rank, frags, width, token)
        words = poll(own + where[i], on, (Uint32(SENTINEL),) * WORDS)
        for k in cutlass.range_constexpr(WORDS):
            held[i, k] = words[k]
    pending = Int32(0)
    for i in cutlass.range_constexpr(unroll):
        pending = pending | (Int32(armed(tuple(held[i, k] for k in range(WORDS))) != 0) << i)
    return pending & exists


@cute.jit
def repoll(own: Int64, held: cute.Tensor, where: cute.Tensor, pending: Int32,
           unroll: cutlass.Constexpr, control: Int64, late: Int32):
    """Poll the dirty fragments of a batch once more, every ``poll`` issued before the
    first check (a spin costs one round trip), and, once the wait is ``late``, the
    mark with them (``late_mark``). Returns ``(the mask still dirty,
    the mark)``."""
    for i in cutlass.range_constexpr(unroll):
        words = poll(own + where[i], (pending >> i) & 1, tuple(held[i, k] for k in range(WORDS)))
        for k in cutlass.range_constexpr(WORDS):
            held[i, k] = words[k]
    mark = late_mark(control, late)
    for i in cutlass.range_constexpr(unroll):
        arrived = Int32(armed(tuple(held[i, k] for k in range(WORDS))) == 0)
        pending = pending & ~(arrived << i)
    return pending, mark


@cute.jit
def deliver(own: Int64, dst: Int64, held: cute.Tensor, where: cute.Tensor, source: cute.Tensor,
            pending: Int32, missing: Int32, base: Int32, stride: Int32, polls: Int32,
            unroll: cutlass.Constexpr, token=None) -> Int32:
    """Copy a batch's arrived fragments out and re-arm them; write the rest as NaN
    (``give_up``). Returns ``missing`` with those fragments' ranks added. Tokens
    (``token`` 1): re-armed, or their ranks missing, and nothing written out."""
    for i in cutlass.range_constexpr(unroll):
        if base + i * stride < polls:
            if (pending >> i) & 1:
                write_out(dst, where[i], (Uint32(NAN_PAIR),) * WORDS, token)  # give_up
                missing = missing | (1 << source[i])
            else:
                take(own, dst, where[i], tuple(held[i, k] for k in range(WORDS)), token)
    return missing


@cute.jit
def write_out(dst: Int64, where: Int64, words, token=None):
    """``words`` at byte ``where`` of the output, unless they answer a token poll
    (``token`` 1: a rank of 0 rows has no output row)."""
    if cutlass.const_expr(token is None):
        store(dst + where, words)
    else:
        if token == 0:
            store(dst + where, words)


@cute.jit
def take(own: Int64, dst: Int64, where: Int64, words, token=None):
    """An arrived fragment (``words``, at byte ``where`` of the box and the output):
    copied out (``write_out``: not a token), then its box slot re-armed. Every path that
    delivers goes through here: the reader re-arms what it copied, and nobody else
    re-arms a box."""
    write_out(dst, where, words, token)
    store(own + where, (Uint32(SENTINEL),) * WORDS)


@cute.jit
def slot(stage: Int32, i: cutlass.Constexpr, tid: Int32, threads: cutlass.Constexpr) -> Int32:
    """The shared address of this thread's slot ``i`` of a batch: ``[unroll][threads]``
    fragments, so a warp's slots are consecutive (no bank conflicts)."""
    return stage + (Int32(i * threads) + tid) * 16


@cute.jit
def push_staged(src: Int64, dst: Int64, targets: cute.Tensor, column: Int64, rows: Int32,
                first: Int32, stride: Int32, mark: Int32, watch, stage: Int32, tid: Int32,
                threads: cutlass.Constexpr, tp: cutlass.Constexpr, frags: cutlass.Constexpr,
                width: cutlass.Constexpr, unroll: cutlass.Constexpr, routing=None, control=None):
    """``push``, the batch's shard fragments staged through shared memory (the mark
    read after the first batch's copies are issued)."""
    pushes = rows * frags
    base = first
    slow = watch[2]
    if cutlass.const_expr(control is not None):
        if first >= pushes:
            mark = mark_of(control)
    while base < pushes:
        if base != first:  # before this batch's stores: a store can stall
            slow = heartbeat(watch[0], watch[1], slow, watch[3], watch[4], watch[5])
        for i in cutlass.range_constexpr(unroll):  # every copy before any store
            f = base + i * stride
            if f < pushes:
                copy_async(slot(stage, i, tid, threads), src + Int64(f) * 16)
        if cutlass.const_expr(control is not None):
            if base == first:
                mark = mark_of(control)
        wait_async()
        again = opaque(base)  # the offsets again, not held across the wait
        for i in cutlass.range_constexpr(unroll):
            f = again + i * stride
            if f < pushes:
                if cutlass.const_expr(routing is None):
                    offset = push_offset(f, column, frags, width)
                    push_fragment(load_shared(slot(stage, i, tid, threads)), offset, dst,
                                  targets, mark, tp)
                else:
                    offset, step, box = route(f, column, routing, targets, frags, width, tp)
                    send_fragment(load_shared(slot(stage, i, tid, threads)), offset, dst, step,
                                  box, mark)
        base = base + stride * unroll
    return slow, mark


@cute.jit
def fetch_staged(own: Int64, dst: Int64, pending: Int32, base: Int32, stride: Int32,
                 polls: Int32, rank: Int32, stage: Int32, tid: Int32,
                 threads: cutlass.Constexpr, frags: cutlass.Constexpr,
                 width: cutlass.Constexpr, unroll: cutlass.Constexpr, token=None) -> Int32:
    """Copy the ``pending`` fragments (``token``: tokens, ``locate``) of a batch into
    their slots, then deliver each that arrived (copy out, re-arm); the mask of those
    still dirty."""
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            where, _ = locate(base + i * stride, rank, frags, width, token)
            copy_async(slot(stage, i, tid, threads), own + where)
    wait_async()
    again = opaque(base)  # the offsets again, not held across the wait
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            words = load_shared(slot(stage, i, tid, threads))
            if armed(words) == 0:
                where, _ = locate(again + i * stride, rank, frags, width, token)
                take(own, dst, where, words, token)
                pending = pending & ~(1 << i)
    return pending


@cute.jit
def repoll_staged(own: Int64, dst: Int64, pending: Int32, base: Int32, stride: Int32,
                  rank: Int32, frags: cutlass.Constexpr, width: cutlass.Constexpr,
                  unroll: cutlass.Constexpr, token=None) -> Int32:
    """Poll a staged batch's dirty fragments (``token``: tokens) once more, one at a
    time with the volatile load (its progress is the memory model's, unlike
    ``cp.async``'s), delivering each that arrived; the mask still dirty. One
    fragment's registers at a time."""
    again = opaque(base)  # the offsets computed here, not held through the wait loop
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            where, _ = locate(again + i * stride, rank, frags, width, token)
            words = load_volatile(own + where)
            if armed(words) == 0:
                take(own, dst, where, words, token)
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
                   unroll: cutlass.Constexpr, token=None) -> Int32:
    """``give_up`` for a staged batch: NaN for every fragment still ``pending`` (not
    for tokens: ``write_out``); ``missing`` with their ranks added."""
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            where, source = locate(base + i * stride, rank, frags, width, token)
            write_out(dst, where, (Uint32(NAN_PAIR),) * WORDS, token)
            missing = missing | (1 << source)
    return missing


@cute.jit
def mark_peers(peers: Int64, missing: Int32, epoch: Int32, status: Int64, serving: Int32,
               tp: cutlass.Constexpr):
    """After this rank's own wait ran out in call ``epoch``: the ``missing`` ranks into
    every rank's control block, a fence, then every rank's mark. The control blocks'
    addresses are read from the peer table here, not held through the poll loop
    (registers: a CTA per SM at TP 8). Serving: first the same ranks into the host
    record (``STATUS_PEERS``, no flag), so a launch that stalls in the stores below has
    told the host whom it found missing."""
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
    """A call after the failed one raises the host flag (``write_record``); the failed call
    itself does not: every rank's flag comes from call s + 1 (docs/design.md, the two
    modes)."""
    mark = mark_of(own_control)
    if mark != 0:
        failed = Int32(MARK_TOP) - mark
        behind = (epoch - failed) & Int32(EPOCH_SPAN - 1)  # calls since the failed one
        if behind != 0:
            if behind < Int32(EPOCH_SPAN // 2):
                write_record(status, own_control, failed, tp)  # fences after the mark's read


@cute.jit
def write_record(status: Int64, own_control: Int64, failed: Int32, tp: cutlass.Constexpr):
    """The host-visible record of a give-up: the missing ranks (from the mark's control
    block), the failed epoch, a system fence, then the flag. Every caller read the mark
    first; the ``fence.acq_rel.sys`` here, first, makes the missing-rank words read at
    least those the mark announces (the marker fenced between them and the mark)."""
    fence_acq_rel_sys()  # acquire: the mark read before, what it announces after
    for p in cutlass.range_constexpr(tp):
        if load_word_volatile(own_control + (CONTROL_MISSING + p) * 4) != Uint32(0):
            store_word_sys(status + (STATUS_PEERS + p) * 4, 1)
    store_word_sys(status + STATUS_EPOCH * 4, failed)
    fence_sys()
    store_word_sys(status + STATUS_FLAG * 4, 1)


__all__ = ["heartbeat", "late_mark", "route", "send_fragment", "push_token", "write_out", "push_staged", "fetch_staged", "repoll_staged", "batch_of", "give_up_staged", "locate", "slot", "take", "take_epoch", "finish", "REPORT_CAUSE", "REPORT_SLOW", "mark_of", "push", "fetch", "repoll", "deliver", "mark_peers",
           "publish", "raise_slow", "record_and_stop", "write_record", "CAUSE_MARK", "CAUSE_TIMEOUT", "load_address"]
