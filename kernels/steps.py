"""The gather's protocol steps as device functions (docs/design.md, "One call, step by
step"). A *fragment* is 16 bytes (``WORDS`` words) of one row of one rank's shard,
published, polled, copied and re-armed whole; offsets are bytes into a parity box or
the output (both ``[rows, width]`` words). Invariants a change must keep:
- Own fragments go scrubbed to the output, never through the own box.
- Only the reader re-arms, and only what it copied, through ``take``.
- A batch's loads are all issued before the first check (predicated, no branch), so
  a poll, a spin and a push's first loads each cost one round trip.
- Serving-only steps sit behind ``serving`` or a thread's ``slow`` flag (1 from the
  start unless serving): a recoverable launch writes none of them and never traps.
- Fences only where ``finish``, ``mark_peers``, ``write_record`` (its callers read the
  mark first) and ``record_and_stop`` place them (tests/test_kernels_ptx.py audits
  each); the re-arms and the epoch need none (docs/design.md, "The mailbox").
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
    return Int32(load_word_volatile(control + CONTROL_MARK * 4))


@cute.jit
def late_mark(control: Int64, late: Int32) -> Int32:
    """``mark_of`` once the wait is ``late``, else 0 with no load."""
    return Int32(load_word_volatile_if(control + CONTROL_MARK * 4, late))


# What a CTA reports to ``finish``: a thread stopped waiting; one raised the heartbeat.
REPORT_CAUSE, REPORT_SLOW = 1, 2


@cute.jit
def take_epoch(control: Int64):
    """Thread 0 of each CTA, before PDL's wait: ``(epoch, last)`` from one atomic add to
    the ticket pair; the last ticket's CTA moves the pair on by an atomic it waits for.
    No fence (docs/design.md, "The mailbox", Epoch)."""
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
    """Thread 0 of each CTA: counts the CTA done. One that ``reported`` releases first;
    served, it records and traps on a cause; on a heartbeat it waits for every CTA's
    count and takes the heartbeat down unless a mark is set."""
    if heartbeat(start, budget, slow, status, control, epoch) != slow:  # its own first: a store may stall
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
    """Serving: ``raise_slow`` once past half the budget unless ``slow``; the new ``slow``."""
    if slow == 0:
        if cute.arch.globaltimer() - start > (budget >> SLOW_SHIFT):
            slow = raise_slow(status, own_control, epoch)
    return slow


@cute.jit
def raise_slow(status: Int64, own_control: Int64, epoch: Int32) -> Int32:
    """``STATUS_SLOW`` = epoch + 1 in host memory; 1, the thread's "raised" flag."""
    store_word_sys(status + STATUS_SLOW * 4, epoch + 1)
    return Int32(1)


@cute.jit
def record_and_stop(status: Int64, own_control: Int64, budget: Int64, epoch: Int32,
                    tp: cutlass.Constexpr):
    """Serving's give-up: the slow heartbeat first (unfenced: if the record's fences stall,
    it is what the host's watchdog sees), the record, then ``trap`` an eighth later."""
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
    """This rank's fragments to the output and, unless the call begins marked, to every
    peer's box (``routing``: each to its one rank). With ``control``, the mark is read
    after the first batch's loads are issued, so the two round trips overlap."""
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
        for i in cutlass.range_constexpr(unroll):
            f = base + i * stride  # i = 0: in the loop, always a fragment
            words = load_if(src + Int64(f) * 16, Int32(f < pushes) if i else Int32(1))
            for k in cutlass.range_constexpr(WORDS):
                held[i, k] = words[k]
        if cutlass.const_expr(control is not None):
            if base == first:
                mark = mark_of(control)
        again = opaque(base)
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
    m = f // frags
    return (Int64(m) * width + column + Int64(f - m * frags) * WORDS) * 4


@cute.jit
def push_fragment(words, offset: Int64, dst: Int64, targets: cute.Tensor, mark: Int32,
                  tp: cutlass.Constexpr):
    clean = tuple(scrub(words[k]) for k in range(WORDS))
    if mark == 0:
        for step in cutlass.range_constexpr(1, tp):
            store_sys(targets[step] + offset, clean)
    store(dst + offset, clean)  # every rank's output holds the same bits


@cute.jit
def route(f: Int32, column: Int64, routing, targets: cute.Tensor, frags: cutlass.Constexpr,
          width: cutlass.Constexpr, tp: cutlass.Constexpr):
    """All-to-all: ``(offset, step, box)`` of fragment ``f``: row m goes to rank q, the last
    with ``offsets[q] <= m`` (non-decreasing: an empty split's rank is never it), as its row
    ``m - offsets[q]``; ``step`` 0: the output."""
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
    clean = tuple(scrub(words[k]) for k in range(WORDS))
    if step == 0:
        store(dst + offset, clean)
    else:
        if mark == 0:
            store_sys(box + offset, clean)


@cute.jit
def push_token(me: Int32, epoch: Int32, column: Int64, routing, peers: Int64, shift: Int64,
               stop: Int32, tp: cutlass.Constexpr):
    """All-to-all: thread q pushes the epoch (never the sentinel) to a peer q of 0 rows this
    call, unless ``stop``, at row 0 of q's box, this rank's columns: no data fills it."""
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
    """Peer fragment ``f`` of this rank's box: ``(byte offset, pushing rank)``, row-major,
    own columns skipped; with ``token`` 1, the f-th peer's token."""
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
    """Issues a batch's polls (past ``polls``: switched off); the dirty ones' mask."""
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
    """Polls a batch's dirty fragments again, and the mark once ``late``: ``(dirty, mark)``."""
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
    """Copies a batch's arrived fragments out; the rest become NaN, their ranks ``missing``."""
    for i in cutlass.range_constexpr(unroll):
        if base + i * stride < polls:
            if (pending >> i) & 1:
                write_out(dst, where[i], (Uint32(NAN_PAIR),) * WORDS, token)
                missing = missing | (1 << source[i])
            else:
                take(own, dst, where[i], tuple(held[i, k] for k in range(WORDS)), token)
    return missing


@cute.jit
def write_out(dst: Int64, where: Int64, words, token=None):
    """``words`` to the output, unless they answer a token poll (no output row)."""
    if cutlass.const_expr(token is None):
        store(dst + where, words)
    else:
        if token == 0:
            store(dst + where, words)


@cute.jit
def take(own: Int64, dst: Int64, where: Int64, words, token=None):
    """Copies an arrived fragment out and re-arms its box slot: the only re-arm."""
    write_out(dst, where, words, token)
    store(own + where, (Uint32(SENTINEL),) * WORDS)


@cute.jit
def slot(stage: Int32, i: cutlass.Constexpr, tid: Int32, threads: cutlass.Constexpr) -> Int32:
    """Shared address of this thread's slot ``i``: ``[unroll][threads]`` fragments, so a
    warp's slots are consecutive. Only its own thread uses a slot: no barrier."""
    return stage + (Int32(i * threads) + tid) * 16


@cute.jit
def push_staged(src: Int64, dst: Int64, targets: cute.Tensor, column: Int64, rows: Int32,
                first: Int32, stride: Int32, mark: Int32, watch, stage: Int32, tid: Int32,
                threads: cutlass.Constexpr, tp: cutlass.Constexpr, frags: cutlass.Constexpr,
                width: cutlass.Constexpr, unroll: cutlass.Constexpr, routing=None, control=None):
    pushes = rows * frags
    base = first
    slow = watch[2]
    if cutlass.const_expr(control is not None):
        if first >= pushes:
            mark = mark_of(control)
    while base < pushes:
        if base != first:
            slow = heartbeat(watch[0], watch[1], slow, watch[3], watch[4], watch[5])
        for i in cutlass.range_constexpr(unroll):
            f = base + i * stride
            if f < pushes:
                copy_async(slot(stage, i, tid, threads), src + Int64(f) * 16)
        if cutlass.const_expr(control is not None):
            if base == first:
                mark = mark_of(control)
        wait_async()
        again = opaque(base)
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
    """Stages a batch's ``pending`` fragments, delivers those that arrived; the mask of the rest."""
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            where, _ = locate(base + i * stride, rank, frags, width, token)
            copy_async(slot(stage, i, tid, threads), own + where)
    wait_async()
    again = opaque(base)
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
    """Polls a staged batch's dirty fragments again, one at a time with the volatile load
    (``cp.async`` is weak), delivering each that arrived; the mask still dirty."""
    again = opaque(base)
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
    mask = Int32(0)
    for i in cutlass.range_constexpr(unroll):
        if base + i * stride < polls:
            mask = mask | (1 << i)
    return mask


@cute.jit
def give_up_staged(dst: Int64, pending: Int32, missing: Int32, base: Int32, stride: Int32,
                   rank: Int32, frags: cutlass.Constexpr, width: cutlass.Constexpr,
                   unroll: cutlass.Constexpr, token=None) -> Int32:
    """``deliver``'s give-up for a staged batch: NaN for each fragment still ``pending``."""
    for i in cutlass.range_constexpr(unroll):
        if (pending >> i) & 1:
            where, source = locate(base + i * stride, rank, frags, width, token)
            write_out(dst, where, (Uint32(NAN_PAIR),) * WORDS, token)
            missing = missing | (1 << source)
    return missing


@cute.jit
def mark_peers(peers: Int64, missing: Int32, epoch: Int32, status: Int64, serving: Int32,
               tp: cutlass.Constexpr):
    """After this rank's own wait ran out: the ``missing`` ranks into every control block,
    a fence, then every rank's mark. Serving tells the host record first (no flag), in
    case the stores stall. Addresses reloaded: not held through the polls."""
    if serving != 0:
        for p in cutlass.range_constexpr(tp):
            if (missing >> p) & 1:
                store_word_sys(status + (STATUS_PEERS + p) * 4, 1)
    for q in cutlass.range_constexpr(tp):
        control = load_address(peers + Int64(PEER_CONTROL * tp + q) * 8)
        for p in cutlass.range_constexpr(tp):
            if (missing >> p) & 1:
                store_word_sys(control + (CONTROL_MISSING + p) * 4, 1)
    fence_sys()  # the missing ranks before the mark that announces them
    for q in cutlass.range_constexpr(tp):
        control = load_address(peers + Int64(PEER_CONTROL * tp + q) * 8)
        atomic_max_word_sys(control + CONTROL_MARK * 4, Int32(MARK_TOP) - epoch)


@cute.jit
def publish(status: Int64, own_control: Int64, epoch: Int32, tp: cutlass.Constexpr):
    """Recoverable: calls after the failed one s raise the host flag, s itself not, so every
    rank's host raises at s + 2 alike."""
    mark = mark_of(own_control)
    if mark != 0:
        failed = Int32(MARK_TOP) - mark
        behind = (epoch - failed) & Int32(EPOCH_SPAN - 1)  # calls since the failed one
        if behind != 0:
            if behind < Int32(EPOCH_SPAN // 2):
                write_record(status, own_control, failed, tp)


@cute.jit
def write_record(status: Int64, own_control: Int64, failed: Int32, tp: cutlass.Constexpr):
    """The host record of a give-up: missing ranks, failed epoch, a system fence, the flag."""
    fence_acq_rel_sys()  # acquire: the mark read before, what it announces after
    for p in cutlass.range_constexpr(tp):
        if load_word_volatile(own_control + (CONTROL_MISSING + p) * 4) != Uint32(0):
            store_word_sys(status + (STATUS_PEERS + p) * 4, 1)
    store_word_sys(status + STATUS_EPOCH * 4, failed)
    fence_sys()
    store_word_sys(status + STATUS_FLAG * 4, 1)


__all__ = ["heartbeat", "late_mark", "route", "send_fragment", "push_token", "write_out", "push_staged", "fetch_staged", "repoll_staged", "batch_of", "give_up_staged", "locate", "slot", "take", "take_epoch", "finish", "REPORT_CAUSE", "REPORT_SLOW", "mark_of", "push", "fetch", "repoll", "deliver", "mark_peers",
           "publish", "raise_slow", "record_and_stop", "write_record", "CAUSE_MARK", "CAUSE_TIMEOUT", "load_address"]
