"""The Lamport logits gather: ``[M, V/TP]`` BF16 shards -> ``[M, V]`` on every rank,
one launch per call (docs/design.md, "One call, step by step"). Invariants:
- Before PDL's wait only the peer table is read and the ticket taken
  (``steps.take_epoch``): the shard, the mark and the done counts are the previous kernels'.
- A call that begins marked pushes nothing and delivers no peer fragment (its box
  may hold late pushes of a void call: NaN until ``reset`` re-arms it). After a give-up the remaining batches are
  fetched once, without waiting, so every missing rank is recorded.
- ``serving`` is a run-time argument, uniform across the grid: one compiled kernel
  serves both modes.
- Every CTA of every rank must be co-resident; the host checks that.
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
    """A gather for ``tp`` ranks of ``shard_words`` words per row. ``all_to_all``'s row
    offsets (docs/design.md, "The all-to-all") are Int32 parameters, by value: no
    device copy, no pointer a graph replay keeps alive."""

    def __init__(self, tp: int, shard_words: int, threads: int, unroll: int, pdl: bool,
                 timers: bool = False, staged: bool = False, all_to_all: bool = False):
        if shard_words % WORDS:
            raise ValueError(f"shard of {shard_words} words is not whole 16-byte fragments")
        self.tp, self.shard_words, self.threads = tp, shard_words, threads
        self.unroll, self.pdl, self.timers = unroll, pdl, timers
        self.staged, self.all_to_all = staged, all_to_all

    @cute.jit
    def stamp(self, stamps, phase: cutlass.Constexpr):
        """Diagnostics (``timers``): the global timer at ``phase``, in registers."""
        if cutlass.const_expr(self.timers):
            stamps[phase] = cute.arch.globaltimer()

    @cute.jit
    def write_stamps(self, status: Int64, stamps, epoch: Int32, cta: Int32, grid: Int32,
                     tid: Int32):
        """Diagnostics: thread 0 stores the CTA's stamps in this call's slot."""
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
        """``(cause, slow, late)`` after a poll left fragments dirty: why the thread stops
        waiting (0: it waits on), the heartbeat flag, whether the next poll reads the mark."""
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
        # Only scalars (``launch.PARAMS``): a host can launch it through the driver.
        self.launch(shard, out, peers, rank, ctas, budget, status, serving, stream, ())

    @cute.jit
    def exchange(self, shard: cute.Tensor, out: Int64, peers: Int64, rank: Int32, ctas: Int32,
                 budget: Int64, status: Int64, serving: Int32, stream, offsets: tuple):
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
        width: cutlass.Constexpr = self.tp * self.shard_words

        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        me = cta * self.threads + tid
        stride = grid * self.threads
        stamps = cute.make_rmem_tensor((len(TIMER_PHASES),), Int64)
        self.stamp(stamps, 0)
        # One allocation, laid out as ``protocol.shared_bytes`` counts it
        slot_words: cutlass.Constexpr = unroll * self.threads * WORDS if self.staged else 0
        block = SmemAllocator().allocate_tensor(
            Uint32, cute.make_layout((SHARED_CONTROL_BYTES // 4 + slot_words,)),
            byte_alignment=16)
        shared = block.iterator.toint()
        stage = shared + SHARED_CONTROL_BYTES
        own_control = load_address(peers + Int64(PEER_CONTROL * tp + rank) * 8)
        firsts = cute.make_rmem_tensor((tp,), Int64)
        for step in cutlass.range_constexpr(tp):
            firsts[step] = load_address(peers + Int64(PEER_PARITY0 * tp + (rank + step) % tp) * 8)
        # parity 1 lies ``span`` on in every box: the parity, known later, costs no reload
        span = load_address(peers + Int64(PEER_PARITY1 * tp + rank) * 8) - firsts[0]

        # The ticket before PDL's wait hides its latency (safe: ``steps.take_epoch``).
        last = Int32(0)
        if tid == 0:
            epoch, last = take_epoch(own_control)
            store_shared_word(shared, epoch)
            store_shared_word(shared + 4, last)  # the move's result: performed before the barrier
        cute.arch.sync_threads()
        epoch = Int32(load_shared_word(shared))
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        start = cute.arch.globaltimer()
        self.stamp(stamps, 1)
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

        slow = Int32(serving == 0)
        watch = (start, budget, slow, status, own_control, epoch)  # ``steps.heartbeat``'s
        # The mark as the call begins: the gather's push reads it, the all-to-all here.
        mark = Int32(0)
        control = own_control
        routing = None
        if cutlass.const_expr(self.all_to_all):
            control = None
            mark = mark_of(own_control)
            routing = (rank, tuple(offsets[q] for q in range(tp + 1)))
            # before the data: one store per thread, too early for a heartbeat
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

        mine = rows
        token = None
        if cutlass.const_expr(self.all_to_all):  # computed here: no register through the push
            mine = Int32(0)
            for q in cutlass.range_constexpr(tp):
                if rank == q:
                    mine = offsets[q + 1] - offsets[q]
            token = Int32(mine == 0)  # 1: polls a token per peer, delivers none
        polls = mine * (tp - 1) * frags
        if cutlass.const_expr(self.all_to_all):
            polls = polls + token * (tp - 1)
        missing = Int32(0)
        cause = Int32(0)
        base = me
        while base < polls:
            if cutlass.const_expr(self.staged):
                pending = batch_of(base, stride, polls, unroll)
                if mark == 0:  # else marked as the call began: deliver none
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
                if mark != 0:
                    pending = Int32((1 << unroll) - 1)
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
        # One barrier says whether any thread reports anything, and only then (the answer
        # is the CTA's, so every thread branches alike) two more say what.
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
