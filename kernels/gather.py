"""The Lamport logits gather: ``[M, V/TP]`` BF16 shards -> ``[M, V]`` on every rank.

Mailbox (one per rank, symmetric): ``[2 parities, cap rows, V/2]`` int32 words, every
word armed with ``SENTINEL``. ``peers[p, r]`` is the address of rank ``r``'s parity-``p``
box; rank ``r``'s shard lands at word columns ``r * S`` (``S = V/TP/2``), the layout
of NCCL's all-gather. ``peers`` is passed as the address of that int64 ``[2, tp]``
table, and ``out`` (a contiguous ``[M, V]`` BF16 tensor the host just allocated) by its
address: ints, not tensors, so a call converts one tensor (the shard, which also
gives M, the device and the stream) instead of three.

One launch per call and parity; invariants a change must keep:

- push: every shard fragment (16 bytes) goes, scrubbed (a sentinel word becomes 0),
  into row m of every *peer's* box with a system-scope store; the rank's own
  fragment goes, scrubbed the same way, straight to the output and never through its
  own box, so every rank's output holds the same bits.
- poll: a thread issues the loads of all its fragments before the first check and
  re-polls only the dirty ones; a fragment is complete when none of its words is the
  sentinel (integer compares).
- the reader re-arms: after copying a fragment to the output, this rank writes the
  sentinel back into its own box. Nobody else ever re-arms it.
- every wait is bounded by ``budget`` nanoseconds of ``%globaltimer``; on expiry the
  thread records (flag, parity, row, missing peers) in the host-visible ``status``
  words and exits without writing the fragment.
- with PDL the kernel waits (``griddepcontrol.wait``) before reading the shard: the
  shard is the previous kernel's output, and the previous gather on this stream must
  have finished re-arming before this one's pushes reach a peer that is ahead.

The grid's CTAs must all be co-resident with the peers' (their polls wait on pushes
from other CTAs); the host checks that, not this module.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from .primitives import (SENTINEL, WORDS, armed, load, load_address, load_volatile, scrub, store,
                         store_sys, store_word_sys)

# Error record (int32 words in host-visible memory): see ``STATUS_*``.
STATUS_FLAG, STATUS_PARITY, STATUS_ROW, STATUS_PEERS = 0, 1, 2, 3


class Gather:
    """One compiled gather for ``tp`` ranks of ``shard_words`` words per row.

    Compile-time: tp, shard width, threads per CTA, fragments in flight per thread
    (``unroll``) and PDL. Run-time: M (the shard's rows), the CTA count, the parity,
    the rank, the spin budget and the status record's address."""

    def __init__(self, tp: int, shard_words: int, threads: int, unroll: int, pdl: bool):
        if shard_words % WORDS:
            raise ValueError(f"shard of {shard_words} words is not whole 16-byte fragments")
        self.tp, self.shard_words, self.threads = tp, shard_words, threads
        self.unroll, self.pdl = unroll, pdl

    @cute.jit
    def __call__(self, shard: cute.Tensor, out: Int64, peers: Int64,
                 parity: Int32, rank: Int32, ctas: Int32, budget: Int64, status: Int64,
                 stream):
        self.kernel(shard, out, peers, parity, rank, budget, status).launch(
            grid=(ctas, 1, 1), block=(self.threads, 1, 1), stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, shard: cute.Tensor, out: Int64, peers: Int64,
               parity: Int32, rank: Int32, budget: Int64, status: Int64):
        tp: cutlass.Constexpr = self.tp
        unroll: cutlass.Constexpr = self.unroll
        span: cutlass.Constexpr = self.shard_words  # words of one rank's shard row
        frags: cutlass.Constexpr = self.shard_words // WORDS  # fragments of it
        width: cutlass.Constexpr = self.tp * self.shard_words  # words of a full row
        others: cutlass.Constexpr = (self.tp - 1) * frags  # peer fragments per row

        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        me = cta * self.threads + tid
        stride = grid * self.threads
        rows = shard.shape[0]

        if cutlass.const_expr(self.pdl):
            # The shard is the previous kernel's output; only then may we read it.
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        start = cute.arch.globaltimer()
        src = Int64(shard.iterator.toint())
        dst = out
        table = peers + Int64(parity * tp) * 8  # this parity's row of the peer table
        own = load_address(table + Int64(rank) * 8)
        column = Int64(rank * span)
        # Peer box addresses in push order (rank + 1, rank + 2, ...), loaded once.
        targets = cute.make_rmem_tensor((tp,), Int64)
        for step in cutlass.range_constexpr(1, tp):
            targets[step] = load_address(table + Int64((rank + step) % tp) * 8)

        # Push: each fragment of this rank's rows to every peer, own copy to out.
        pushes = rows * frags
        base = me
        while base < pushes:
            held = cute.make_rmem_tensor((unroll, WORDS), Uint32)
            for i in cutlass.range_constexpr(unroll):
                f = base + i * stride
                if f < pushes:
                    words = load(src + Int64(f) * 16)
                    for k in cutlass.range_constexpr(WORDS):
                        held[i, k] = words[k]
            for i in cutlass.range_constexpr(unroll):
                f = base + i * stride
                if f < pushes:
                    m = f // frags
                    offset = (Int64(m) * width + column + Int64(f - m * frags) * WORDS) * 4
                    clean = tuple(scrub(held[i, k]) for k in range(WORDS))
                    for step in cutlass.range_constexpr(1, tp):
                        store_sys(targets[step] + offset, clean)
                    store(dst + offset, clean)  # every rank gets the same bits
            base = base + stride * unroll

        # Poll this rank's own box for the peers' fragments; copy out and re-arm.
        polls = rows * others
        base = me
        late = Int32(0)
        while (base < polls) & (late == 0):
            held = cute.make_rmem_tensor((unroll, WORDS), Uint32)
            where = cute.make_rmem_tensor((unroll,), Int64)
            pending = Int32(0)
            for i in cutlass.range_constexpr(unroll):
                f = base + i * stride
                where[i] = Int64(0)
                if f < polls:
                    m = f // others
                    j = f - m * others
                    j = j + frags * Int32(j >= rank * frags)  # skip our own columns
                    where[i] = (Int64(m) * width + Int64(j) * WORDS) * 4
                    words = load_volatile(own + where[i])
                    for k in cutlass.range_constexpr(WORDS):
                        held[i, k] = words[k]
                    if armed(words) != 0:
                        pending = pending | (1 << i)
            while (pending != 0) & (late == 0):
                for i in cutlass.range_constexpr(unroll):
                    if (pending >> i) & 1:
                        words = load_volatile(own + where[i])
                        for k in cutlass.range_constexpr(WORDS):
                            held[i, k] = words[k]
                        if armed(words) == 0:
                            pending = pending & ~(1 << i)
                if cute.arch.globaltimer() - start > budget:
                    late = Int32(1)
            for i in cutlass.range_constexpr(unroll):
                f = base + i * stride
                if f < polls:
                    if (pending >> i) & 1:
                        m = f // others
                        peer = Int32(where[i] // 4 % width) // span
                        store_word_sys(status + STATUS_PARITY * 4, parity)
                        store_word_sys(status + STATUS_ROW * 4, m)
                        store_word_sys(status + (STATUS_PEERS + Int64(peer)) * 4, 1)
                        store_word_sys(status + STATUS_FLAG * 4, 1)
                    else:
                        store(dst + where[i], tuple(held[i, k] for k in range(WORDS)))
                        store(own + where[i], (Uint32(SENTINEL),) * WORDS)
            base = base + stride * unroll
