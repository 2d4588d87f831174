"""Memory primitives of the Lamport gather, as single inline-PTX instructions.

Every mailbox access moves one 16-byte fragment (four 32-bit words) so that a
fragment is published or armed as a whole:

- ``store_sys``: ``st.relaxed.sys.global.v4`` — a push into a peer's mailbox, which
  another GPU polls; relaxed at system scope so it is neither cached nor merged.
- ``load_volatile``: ``ld.volatile.global.v4`` — a poll of this rank's own mailbox;
  volatile so every re-poll goes to memory.
- ``load``/``store``: plain 16-byte accesses for the shard (written before the
  kernel starts) and the output and re-arm (read after the kernel ends).
- ``scrub``: a word equal to the sentinel becomes 0; compared as integers, since
  a float compare would treat the BF16 pair (+0, -0) as zero and ftz could flush
  denormal pairs to it.
- ``load_word_volatile``/``store_word_sys``/``fence_sys``: the control words (the
  fail-stop mark in every mailbox and the host-visible status record): details are
  stored, then ``fence.sc.sys``, then the flag, so a reader that sees the flag sees
  the details.
- ``fence_acq_rel_sys``/``fence_acq_rel_gpu``: the acquire/release fences of the
  protocol's other orderings (``steps``: which fence protects which invariant): the
  re-arm before the same parity's next push, the last-CTA count, a mark before what
  it announces.
- ``copy_async``/``wait_async``/``load_shared``: the staged variant's fragments go
  from global memory into the thread's own shared-memory slots with ``cp.async.cg``
  (through L2), so a batch in flight
  holds no registers; ``wait_async`` (``cp.async.wait_all``) makes them readable by
  the thread that issued them (each thread reads only its own slots: no barrier).
  ``.cg`` bypasses L1 (SASS: ``LDGSTS.E.BYPASS``) and reads L2, where the peers'
  pushes land. The PTX memory model calls ``cp.async`` a weak operation, so only a
  batch's first read is staged: a fragment still armed is polled again with the
  volatile load, whose progress the model gives. A read older than a peer's store
  can only see the sentinel (a fragment is taken only when no word is): time, never
  bits.
- ``trap``: a gather that gives up in a serving process stops its context, after
  its record is out (``steps.record_and_stop``).

Pointer operands are raw 64-bit global addresses (``Int64``).
"""

from functools import wraps

from cutlass import Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .protocol import SENTINEL


def _asm(code, constraints, operands, results, effects, loc, ip):
    values = [v.ir_value(loc=loc, ip=ip) for v in operands]
    if not results:
        llvm.inline_asm(None, values, code, constraints, has_side_effects=effects,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
        return None
    struct = llvm.StructType.get_literal([Uint32.mlir_type] * results)
    packed = llvm.inline_asm(struct, values, code, constraints, has_side_effects=effects,
                             asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return tuple(
        Uint32(llvm.extractvalue(Uint32.mlir_type, packed, [i], loc=loc, ip=ip))
        for i in range(results)
    )


def _op(fn):
    return dsl_user_op(wraps(fn)(fn))


@_op
def load(address, *, loc=None, ip=None):
    """Four words at ``address``: a plain 16-byte load (the rank's own shard)."""
    return _asm("ld.global.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l",
                [Int64(address)], 4, True, loc, ip)


@_op
def load_address(address, *, loc=None, ip=None):
    """The 64-bit word at ``address`` (an entry of the peer table)."""
    values = [Int64(address).ir_value(loc=loc, ip=ip)]
    word = llvm.inline_asm(Int64.mlir_type, values, "ld.global.b64 $0, [$1];", "=l,l",
                           has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                           loc=loc, ip=ip)
    return Int64(word)


@_op
def load_volatile(address, *, loc=None, ip=None):
    """Four words at ``address``, read from memory on every call (a mailbox poll)."""
    return _asm("ld.volatile.global.v4.u32 {$0,$1,$2,$3}, [$4];",
                "=r,=r,=r,=r,l,~{memory}", [Int64(address)], 4, True, loc, ip)


@_op
def copy_async(shared, address, *, loc=None, ip=None):
    """Starts copying the 16 bytes at global ``address`` into shared ``shared`` (a
    32-bit shared-memory address), through L2; visible after ``wait_async``."""
    _asm("cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}",
         [Int32(shared), Int64(address)], 0, True, loc, ip)


@_op
def wait_async(*, loc=None, ip=None):
    """Waits for every ``copy_async`` this thread started."""
    _asm("cp.async.wait_all;", "~{memory}", [], 0, True, loc, ip)


@_op
def load_shared(shared, *, loc=None, ip=None):
    """Four words at the 32-bit shared-memory address ``shared``."""
    return _asm("ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                [Int32(shared)], 4, True, loc, ip)


@_op
def store(address, words, *, loc=None, ip=None):
    """Four words to ``address``: a plain 16-byte store (output, re-arm)."""
    _asm("st.global.v4.u32 [$0], {$1,$2,$3,$4};", "l,r,r,r,r,~{memory}",
         [Int64(address), *(Uint32(w) for w in words)], 0, True, loc, ip)


@_op
def store_sys(address, words, *, loc=None, ip=None):
    """Four words to ``address`` with a relaxed system-scope store (a peer push)."""
    _asm("st.relaxed.sys.global.v4.u32 [$0], {$1,$2,$3,$4};", "l,r,r,r,r,~{memory}",
         [Int64(address), *(Uint32(w) for w in words)], 0, True, loc, ip)


@_op
def store_word_sys(address, word, *, loc=None, ip=None):
    """One word to ``address`` at system scope (the host-visible error record)."""
    _asm("st.relaxed.sys.global.u32 [$0], $1;", "l,r,~{memory}",
         [Int64(address), Uint32(word)], 0, True, loc, ip)


@_op
def load_word_volatile(address, *, loc=None, ip=None):
    """One word at ``address``, read from memory on every call (a control word)."""
    (word,) = _asm("ld.volatile.global.u32 $0, [$1];", "=r,l,~{memory}", [Int64(address)], 1,
                   True, loc, ip)
    return word


@_op
def store_word(address, word, *, loc=None, ip=None):
    """One word to ``address``, a plain store (this rank's own control words)."""
    _asm("st.global.u32 [$0], $1;", "l,r,~{memory}", [Int64(address), Uint32(word)], 0, True,
         loc, ip)


@_op
def atomic_add_word(address, value, *, loc=None, ip=None):
    """Adds ``value`` to the word at ``address`` (device scope); the old word."""
    (old,) = _asm("atom.global.add.u32 $0, [$1], $2;", "=r,l,r,~{memory}",
                  [Int64(address), Uint32(value)], 1, True, loc, ip)
    return old


@_op
def atomic_max_word_sys(address, value, *, loc=None, ip=None):
    """Raises the word at ``address`` to ``value`` at system scope (a peer's mark)."""
    _asm("atom.sys.global.max.u32 $0, [$1], $2;", "=r,l,r,~{memory}",
         [Int64(address), Uint32(value)], 1, True, loc, ip)


@_op
def fence_sys(*, loc=None, ip=None):
    """Orders this thread's earlier stores before its later ones at system scope."""
    _asm("fence.sc.sys;", "~{memory}", [], 0, True, loc, ip)


@_op
def fence_acq_rel_sys(*, loc=None, ip=None):
    """``fence.acq_rel.sys``: a release for this thread's later strong stores (of what
    it did or observed before) and an acquire for its earlier strong loads (of what
    their writers released), towards every thread of the system (peer GPUs, host)."""
    _asm("fence.acq_rel.sys;", "~{memory}", [], 0, True, loc, ip)


@_op
def fence_acq_rel_gpu(*, loc=None, ip=None):
    """``fence.acq_rel.gpu``: the same towards the threads of this GPU only (the
    launch's other CTAs: the last-CTA pattern of ``steps.advance``)."""
    _asm("fence.acq_rel.gpu;", "~{memory}", [], 0, True, loc, ip)


@_op
def trap(*, loc=None, ip=None):
    """Stops the kernel and with it the CUDA context of this process: every later
    stream operation (the engine's next copy of this step's tokens) raises."""
    _asm("trap;", "~{memory}", [], 0, True, loc, ip)


@_op
def scrub(word, *, loc=None, ip=None):
    """``word``, or 0 where it equals the sentinel (an integer compare)."""
    code = ("{ .reg .pred s; setp.eq.u32 s, $1, " + hex(SENTINEL) + "; "
            "selp.u32 $0, 0, $1, s; }")
    (out,) = _asm(code, "=r,r", [Uint32(word)], 1, False, loc, ip)
    return out


@_op
def opaque(value, *, loc=None, ip=None):
    """``value``, which the compiler may not trace back to how it was computed: what
    is derived from it is computed again here instead of held in registers since."""
    (out,) = _asm("mov.b32 $0, $1;", "=r,r,~{memory}", [Int32(value)], 1, True, loc, ip)
    return Int32(out)


def armed(words):
    """Number of sentinel words among ``words`` (0: the fragment has arrived)."""
    count = Int32(0)
    for w in words:
        count = count + Int32(Uint32(w) == Uint32(SENTINEL))
    return count
