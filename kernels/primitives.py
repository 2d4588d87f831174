"""Memory primitives of the Lamport gather, as single inline-PTX instructions.

Every mailbox access moves one 16-byte fragment (four words), so a fragment is
published or armed whole:

- ``store_sys`` (``st.relaxed.sys.global.v4``): a push into a peer's mailbox.
- ``load_volatile`` (``ld.volatile.global.v4``): a poll; every re-poll goes to memory.
- ``load``/``store``: plain accesses for the shard, the output and the re-arm.
- ``scrub``: the sentinel word becomes 0, compared as an integer (a float compare
  takes (+0, -0) for zero; ftz could flush denormal pairs to it).
- ``load_word_volatile``/``store_word_sys``/``fence_sys``: control words and the
  status record (details, ``fence.sc.sys``, then the flag).
- ``fence_acq_rel_sys``/``fence_acq_rel_gpu``: the orderings ``steps`` lists.
- ``copy_async``/``wait_async``/``load_shared``: the staged variant
  (``cp.async.cg``, through L2, into the thread's own slots: no barrier). ``cp.async``
  is weak in the PTX model, so only a batch's first read is staged; a fragment still
  armed is polled again with the volatile load. A stale read sees the sentinel: time
  lost, never bits.
- ``trap``: serving's stop, after the record is out (``steps.record_and_stop``).

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
