"""The Lamport logits gather: ``[M, V/TP]`` BF16 shards -> ``[M, V]`` on every rank.

One launch per call; ``Gather.kernel`` is the protocol step by step (docs/design.md,
"One call, step by step"; ``steps``: each step and its invariant; ``protocol``: the
layout). ``peers`` and ``out`` come as addresses, so a call converts one tensor.

Invariants a change must keep:

- Before PDL's wait only the peer table is read: the shard and the epoch are the
  previous kernels'.
- A call that begins marked pushes nothing and delivers no peer fragment (its box
  may hold late pushes of a void call: NaN instead, until ``reset``). After a
  give-up the remaining batches are fetched once, without waiting, so every missing
  rank is recorded.
- ``serving`` is a run-time argument, uniform across the grid: serving-only steps
  sit behind it and the recoverable-only ``publish`` behind its negation, so one
  compiled kernel serves both modes (the PTX audit evaluates both values).
- Staged batches (``protocol.STAGED_FROM`` or more fragments per thread) differ only
  in the order a batch's fragments are copied out and re-armed.
- Every CTA of every rank must be co-resident; the host checks that, not this module.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32
from cutlass.memory.smem import SmemAllocator

from .primitives import barrier_any, load_address, load_shared_word, store_shared_word, store_word
from .protocol import (CONTROL_DONE, GIVE_UP_SHIFT, MARK_AFTER_NS, PEER_CONTROL, PEER_PARITY0, PEER_PARITY1,
                       SHARED_CONTROL_BYTES, SLOW_SHIFT, TIMER_BASE, TIMER_CALLS, TIMER_PHASES,
                       WORDS)
from .steps import (CAUSE_MARK, CAUSE_TIMEOUT, REPORT_CAUSE, REPORT_SLOW, batch_of, deliver, fetch,
                    fetch_staged, finish, give_up_staged, late_mark, mark_of, mark_peers, publish, push,
                    push_staged, push_token, raise_slow, repoll, repoll_staged, take_epoch)


class Gather:
    """One compiled gather for ``tp`` ranks of ``shard_words`` words per row.

    Compile-time: tp, shard width, threads per CTA, fragments in flight per thread
    (``unroll``), PDL, ``timers`` (diagnostics: per-CTA phase timestamps after the
    status record) and ``staged`` (batches through shared memory:
    ``protocol.staged``). Run-time: M (the shard's rows), the CTA count, the rank,
    the spin budget, the status record's address and ``serving`` (1: serving's
    give-up, trap; 0: the recoverable one; see ``protocol``); the parity comes from
    the rank's epoch in device memory.

    ``all_to_all`` (compile-time): the same protocol, addressed by rank. Shard rows
    ``offsets[q]..offsets[q + 1]`` go to rank q, into rows from 0 of its box (this
    rank's own: straight to the output), and this rank polls and delivers only its
    ``offsets[rank + 1] - offsets[rank]`` rows of every peer: the output is
    ``[that, tp * shard]``. The offsets (prefix sums of the splits, the same on
    every rank, ``offsets[tp]`` = M) change every call, so they are run-time: the
    kernel's last ``MAX_TP + 1`` Int32 parameters (``launch.ALL_TO_ALL_PARAMS``), by
    value, so a launch needs no device copy of them and a graph replay no pointer
    kept alive; only ``offsets[0..tp]`` are read (compile-time indices: no local
    memory). Every rank waits on every peer every call, as in the gather, so none
    runs more than a call ahead and a re-arm precedes the same parity's next push
    (docs/design.md, "Parities and re-arm"): a rank q of 0 rows this call gets from
    every peer one token (``steps.push_token``: the epoch, a system-scope store, row 0
    of q's box at the peer's columns, which no data fills while q has no row), polls
    those tp - 1 as data (budget, give-up, mark), re-arms them and delivers nothing;
    its epoch advances. With ``all_to_all`` False the kernel is the gather, parameter
    for parameter, its PTX unchanged."""

    def __init__(self, tp: int, shard_words: int, threads: int, unroll: int, pdl: bool,
                 timers: bool = False, staged: bool = False, all_to_all: bool = False):
        if shard_words % WORDS:
            raise ValueError(f"shard of {shard_words} words is not whole 16-byte fragments")
        self.tp, self.shard_words, self.threads = tp, shard_words, threads
        self.unroll, self.pdl, self.timers = unroll, pdl, timers
        self.staged, self.all_to_all = staged, all_to_all

    @cute.jit
    def stamp(self, stamps, phase: cutlass.Constexpr):
        """Diagnostics (``timers``): the global timer at ``phase``
        (``protocol.TIMER_PHASES``) into this thread's registers; ``write_stamps``
        stores them once the call's epoch is known."""
        if cutlass.const_expr(self.timers):
            stamps[phase] = cute.arch.globaltimer()

    @cute.jit
    def write_stamps(self, status: Int64, stamps, epoch: Int32, cta: Int32, grid: Int32,
                     tid: Int32):
        """Diagnostics: thread 0 of the CTA stores its stamps after the status record,
        in the slot of this call (``protocol.timer_index``), so calls launched back to
        back without a sync each keep theirs."""
        if cutlass.const_expr(self.timers):
            if tid == 0:
                slot = (epoch % TIMER_CALLS) * grid + cta
                for phase in cutlass.range_constexpr(len(TIMER_PHASES)):
                    at = status + (Int64(TIMER_BASE) + Int64(slot) * len(TIMER_PHASES)
                                   + phase) * 8
                    store_word(at, Int32(stamps[phase] & Int64(0xFFFFFFFF)))
                    store_word(at + 4, Int32(stamps[phase] >> 32))

    @cute.jit
    def still_waiting(self, start: Int64, wait: Int64, budget: Int64, slow: Int32, status: Int64,
                      own_control: Int64, epoch: Int32, mark: Int32):
        """After a poll that left fragments dirty: ``(cause, slow, late)``: why this
        thread stops waiting (0: it waits on; ``CAUSE_TIMEOUT`` past ``wait``,
        ``CAUSE_MARK`` once a peer gave up: ``mark``, read with the polls once past
        ``MARK_AFTER_NS``), whether it raised serving's slow heartbeat (at half the
        budget, once: ``slow`` starts at 1 unless serving), and whether the next poll
        reads the mark (``steps.late_mark``)."""
        waited = cute.arch.globaltimer() - start
        if slow == 0:
            if waited > (budget >> SLOW_SHIFT):
                slow = raise_slow(status, own_control, epoch)
        cause = Int32(0)  # CAUSE_TIMEOUT implies the heartbeat is up: wait > budget / 2
        if waited > wait:
            cause = Int32(CAUSE_TIMEOUT)
        elif mark != 0:
            cause = Int32(CAUSE_MARK)
        return cause, slow, Int32(waited > Int64(MARK_AFTER_NS))

    @cute.jit
    def __call__(self, shard: cute.Tensor, out: Int64, peers: Int64, rank: Int32, ctas: Int32,
                 budget: Int64, status: Int64, serving: Int32, stream):
        # The kernel takes only scalars (``launch.PARAMS``): a host can launch it
        # straight through the driver with no tensor to convert.
        self.launch(shard, out, peers, rank, ctas, budget, status, serving, stream, ())

    @cute.jit
    def exchange(self, shard: cute.Tensor, out: Int64, peers: Int64, rank: Int32, ctas: Int32,
                 budget: Int64, status: Int64, serving: Int32, stream, offsets: tuple):
        """The all-to-all's entry: ``__call__``'s arguments, then the ``MAX_TP + 1`` row
        offsets (``launch.ALL_TO_ALL_PARAMS``)."""
        self.launch(shard, out, peers, rank, ctas, budget, status, serving, stream, offsets)

    def launch(self, shard, out, peers, rank, ctas, budget, status, serving, stream, offsets):
        self.kernel(Int64(shard.iterator.toint()), Int32(shard.shape[0]), out, peers, rank,
                    budget, status, serving, offsets).launch(
            grid=(ctas, 1, 1), block=(self.threads, 1, 1), stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, shard: Int64, rows: Int32, out: Int64, peers: Int64, rank: Int32,
               budget: Int64, status: Int64, serving: Int32, offsets):
        tp: cutlass.Constexpr = self.tp
        unroll: cutlass.Constexpr = self.unroll
        frags: cutlass.Constexpr = self.shard_words // WORDS  # fragments of a shard row
        width: cutlass.Constexpr = self.tp * self.shard_words  # words of a full row

        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        me = cta * self.threads + tid
        stride = grid * self.threads
        stamps = cute.make_rmem_tensor((len(TIMER_PHASES),), Int64)  # diagnostics only
        self.stamp(stamps, 0)
        # One shared allocation, so its layout is ``protocol.shared_bytes``'s: the
        # CTA's control words (``SHARED_CONTROL_BYTES``: [0] the epoch thread 0 took),
        # then, staged, each thread's ``unroll`` slots of 16 bytes (``steps.slot``)
        slot_words: cutlass.Constexpr = unroll * self.threads * WORDS if self.staged else 0
        block = SmemAllocator().allocate_tensor(
            Uint32, cute.make_layout((SHARED_CONTROL_BYTES // 4 + slot_words,)),
            byte_alignment=16)
        shared = block.iterator.toint()
        stage = shared + SHARED_CONTROL_BYTES
        # Prologue: nothing here depends on the previous kernel (the peer table is
        # written once, at construction), so with PDL it overlaps that kernel's tail
        # (the lm_head GEMM in serving). Box addresses in push order (rank, rank + 1,
        # ...) for parity 0; parity 1 lies ``span`` bytes further in every rank's box
        # (``protocol``: one layout per rank), so the parity, known only after the
        # wait, costs no second round of loads.
        own_control = load_address(peers + Int64(PEER_CONTROL * tp + rank) * 8)
        firsts = cute.make_rmem_tensor((tp,), Int64)
        for step in cutlass.range_constexpr(tp):
            firsts[step] = load_address(peers + Int64(PEER_PARITY0 * tp + (rank + step) % tp) * 8)
        span = load_address(peers + Int64(PEER_PARITY1 * tp + rank) * 8) - firsts[0]

        # One ticket per CTA (``steps.take_epoch``), before PDL's wait: its epoch,
        # broadcast through shared memory. The previous launch's CTAs each took theirs
        # before they let this launch start (their ``launch_dependents`` follows), and
        # its last ticket moved the epoch on by an atomic that had returned, so the
        # ticket's latency hides behind the previous kernel's tail. Nothing is left to
        # count at the end but the done count.
        last = Int32(0)  # thread 0 of the CTA that took the launch's last ticket
        if tid == 0:
            epoch, last = take_epoch(own_control)
            store_shared_word(shared, epoch)
            store_shared_word(shared + 4, last)  # the move's result: performed before the barrier
        cute.arch.sync_threads()
        epoch = Int32(load_shared_word(shared))
        if cutlass.const_expr(self.pdl):
            # The shard is the previous kernel's output, the mark and the done counts
            # the previous gather's: all only after the wait.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        start = cute.arch.globaltimer()
        self.stamp(stamps, 1)
        # Serving gives up at three quarters and traps an eighth later (``steps.finish``):
        # stopped within the budget, and a peer that gave up at the same moment has
        # finished marking this rank's mailbox before it traps. Recoverable: the budget.
        wait = budget
        if serving != 0:
            wait = budget - (budget >> GIVE_UP_SHIFT)
        if tid == 0:
            if last != 0:  # the next launch's done count: the previous one has ended
                store_word(own_control + (CONTROL_DONE + ((epoch + 1) & 1)) * 4, 0)
        parity = epoch & 1
        targets = cute.make_rmem_tensor((tp,), Int64)
        for step in cutlass.range_constexpr(tp):
            targets[step] = firsts[step] + Int64(parity) * span
        own = targets[0]

        # 1 once this thread raised STATUS_SLOW, and from the start unless serving
        # (nothing to raise): the heartbeats test this one flag, never ``serving``
        slow = Int32(serving == 0)
        watch = (start, budget, slow, status, own_control, epoch)  # serving's heartbeat
        # The mark as the call begins (non-zero: a call before this one failed): the
        # gather's push reads it once its first loads are out, the all-to-all's here,
        # before its token; its first test waits for it.
        mark = Int32(0)
        control = own_control
        routing = None  # the gather: every fragment to every rank
        if cutlass.const_expr(self.all_to_all):
            control = None
            mark = mark_of(own_control)
            routing = (rank, tuple(offsets[q] for q in range(tp + 1)))
            # before the data: one store of a thread, at the start (no heartbeat due yet)
            push_token(me, epoch, Int64(rank * self.shard_words), routing, peers,
                       Int64(parity) * span, mark, tp)
        if cutlass.const_expr(self.staged):
            slow, mark = push_staged(shard, out, targets, Int64(rank * self.shard_words), rows,
                                     me, stride, mark, watch, stage, tid, self.threads, tp,
                                     frags, width, unroll, routing, control)
        else:
            slow, mark = push(shard, out, targets, Int64(rank * self.shard_words), rows,
                              me, stride, mark, watch, tp, frags, width, unroll, routing,
                              control)
        self.stamp(stamps, 2)

        mine = rows  # rows this rank delivers
        token = None  # the gather's: no token (compile-time: its kernel is unchanged)
        if cutlass.const_expr(self.all_to_all):  # computed here: no register through the push
            mine = Int32(0)
            for q in cutlass.range_constexpr(tp):
                if rank == q:
                    mine = offsets[q + 1] - offsets[q]
            token = Int32(mine == 0)  # 1: this call polls a token per peer, delivers none
        polls = mine * (tp - 1) * frags
        if cutlass.const_expr(self.all_to_all):
            polls = polls + token * (tp - 1)  # 0 rows: the peers' tokens (``push_token``)
        missing = Int32(0)
        cause = Int32(0)
        base = me
        while base < polls:
            if cutlass.const_expr(self.staged):
                pending = batch_of(base, stride, polls, unroll)
                if mark == 0:  # marked before this call began: deliver none (below)
                    pending = fetch_staged(own, out, pending, base, stride, polls, rank, stage,
                                           tid, self.threads, frags, width, unroll, token)
                else:
                    cause = Int32(CAUSE_MARK)
                late = Int32(0)
                while (pending != 0) & (cause == 0):
                    pending = repoll_staged(own, out, pending, base, stride, rank, frags, width,
                                            unroll, token)
                    seen = late_mark(own_control, late)
                    if pending != 0:  # a batch that just completed is never a give-up
                        cause, slow, late = self.still_waiting(start, wait, budget, slow, status,
                                                               own_control, epoch, seen)
                missing = give_up_staged(out, pending, missing, base, stride, rank, frags, width,
                                         unroll, token)
            else:
                held = cute.make_rmem_tensor((unroll, WORDS), Uint32)
                where = cute.make_rmem_tensor((unroll,), Int64)
                source = cute.make_rmem_tensor((unroll,), Int32)
                pending = fetch(own, held, where, source, base, stride, polls, rank, frags, width,
                                unroll, token)
                if mark != 0:  # marked before this call began: its box may hold late
                    pending = Int32((1 << unroll) - 1)  # pushes of a void call; deliver none
                    cause = Int32(CAUSE_MARK)
                late = Int32(0)
                while (pending != 0) & (cause == 0):
                    pending, seen = repoll(own, held, where, pending, unroll, own_control, late)
                    if pending != 0:  # a batch that just completed is never a give-up
                        cause, slow, late = self.still_waiting(start, wait, budget, slow, status,
                                                               own_control, epoch, seen)
                missing = deliver(own, out, held, where, source, pending, missing, base, stride,
                                  polls, unroll, token)
            base = base + stride * unroll
        if mark != 0:  # also a thread with nothing to poll
            cause = Int32(CAUSE_MARK)
        self.stamp(stamps, 3)
        if cause == CAUSE_TIMEOUT:
            mark_peers(peers, missing, epoch, status, serving, tp)
        if serving == 0:  # recoverable: serving's record is ``record_and_stop``'s
            if cause != 0:
                publish(status, own_control, epoch, tp)
        # What the CTA's threads report to its ``finish``: one barrier says whether any
        # thread has anything (a cause, or serving's heartbeat raised), and only then
        # (the answer is the CTA's, so every thread branches alike) two more say what
        raised = (serving != 0) & (slow != 0)
        reported = Int32(barrier_any(Int32(cause != 0) | Int32(raised)))
        if reported != 0:
            reported = (Int32(barrier_any(cause)) * REPORT_CAUSE
                        | Int32(barrier_any(Int32(raised))) * REPORT_SLOW)
        if tid == 0:
            finish(own_control, epoch, reported, status, budget,
                   start, slow, serving, tp)
        self.stamp(stamps, 4)
        self.write_stamps(status, stamps, epoch, cta, grid, tid)
