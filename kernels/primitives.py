"""Memory primitives of the Lamport gather, each one inline-PTX instruction on raw
64-bit global addresses (``Int64``); a mailbox access moves a whole 16-byte fragment.
Polls are volatile, so every re-poll goes to memory; the predicated forms let a
batch's loads issue back to back with no branch. ``cp.async`` is weak in the PTX
model, so only a batch's first read is staged and a fragment still armed is polled
again with the volatile load: a stale read sees the sentinel, time lost, never bits.
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
def load_if(address, on, *, loc=None, ip=None):
    """``load`` at ``address`` if ``on`` is non-zero, else four zeros."""
    code = ("{ .reg .pred p; setp.ne.u32 p, $4, 0; mov.u32 $0, 0; mov.u32 $1, 0; "
            "mov.u32 $2, 0; mov.u32 $3, 0; @p ld.global.v4.u32 {$0,$1,$2,$3}, [$5]; }")
    return _asm(code, "=r,=r,=r,=r,r,l", [Int32(on), Int64(address)], 4, True, loc, ip)


@_op
def load_address(address, *, loc=None, ip=None):
    values = [Int64(address).ir_value(loc=loc, ip=ip)]
    word = llvm.inline_asm(Int64.mlir_type, values, "ld.global.b64 $0, [$1];", "=l,l",
                           has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                           loc=loc, ip=ip)
    return Int64(word)


@_op
def load_volatile(address, *, loc=None, ip=None):
    return _asm("ld.volatile.global.v4.u32 {$0,$1,$2,$3}, [$4];",
                "=r,=r,=r,=r,l,~{memory}", [Int64(address)], 4, True, loc, ip)


@_op
def poll(address, on, words, *, loc=None, ip=None):
    """``load_volatile`` if ``on`` is non-zero, else ``words`` (tied: no extra registers)."""
    code = ("{ .reg .pred p; setp.ne.u32 p, $4, 0; "
            "@p ld.volatile.global.v4.u32 {$0,$1,$2,$3}, [$5]; }")
    return _asm(code, "=r,=r,=r,=r,r,l,0,1,2,3,~{memory}",
                [Int32(on), Int64(address), *(Uint32(w) for w in words)], 4, True, loc, ip)


@_op
def copy_async(shared, address, *, loc=None, ip=None):
    """Starts copying 16 bytes at ``address`` to 32-bit shared address ``shared``, via L2."""
    _asm("cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}",
         [Int32(shared), Int64(address)], 0, True, loc, ip)


@_op
def wait_async(*, loc=None, ip=None):
    _asm("cp.async.wait_all;", "~{memory}", [], 0, True, loc, ip)


@_op
def load_shared(shared, *, loc=None, ip=None):
    return _asm("ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                [Int32(shared)], 4, True, loc, ip)


@_op
def store(address, words, *, loc=None, ip=None):
    """Four words to ``address``: a plain 16-byte store (output, re-arm)."""
    _asm("st.global.v4.u32 [$0], {$1,$2,$3,$4};", "l,r,r,r,r,~{memory}",
         [Int64(address), *(Uint32(w) for w in words)], 0, True, loc, ip)


@_op
def store_sys(address, words, *, loc=None, ip=None):
    _asm("st.relaxed.sys.global.v4.u32 [$0], {$1,$2,$3,$4};", "l,r,r,r,r,~{memory}",
         [Int64(address), *(Uint32(w) for w in words)], 0, True, loc, ip)


@_op
def store_word_sys(address, word, *, loc=None, ip=None):
    _asm("st.relaxed.sys.global.u32 [$0], $1;", "l,r,~{memory}",
         [Int64(address), Uint32(word)], 0, True, loc, ip)


@_op
def load_word_volatile(address, *, loc=None, ip=None):
    (word,) = _asm("ld.volatile.global.u32 $0, [$1];", "=r,l,~{memory}", [Int64(address)], 1,
                   True, loc, ip)
    return word


@_op
def load_word_volatile_if(address, on, *, loc=None, ip=None):
    """``load_word_volatile`` at ``address`` if ``on`` is non-zero, else 0."""
    code = ("{ .reg .pred p; setp.ne.u32 p, $1, 0; mov.u32 $0, 0; "
            "@p ld.volatile.global.u32 $0, [$2]; }")
    (word,) = _asm(code, "=r,r,l,~{memory}", [Int32(on), Int64(address)], 1, True, loc, ip)
    return word


@_op
def store_word(address, word, *, loc=None, ip=None):
    """A plain store: this rank's own control words."""
    _asm("st.global.u32 [$0], $1;", "l,r,~{memory}", [Int64(address), Uint32(word)], 0, True,
         loc, ip)


@_op
def take_ticket(address, value, *, loc=None, ip=None):
    """Adds ``value`` to the 64-bit pair (low, high) at ``address`` (8-byte aligned) and
    returns the old pair: one atomic read of both, performed once the caller has it."""
    values = [Int64(address).ir_value(loc=loc, ip=ip), Int64(value).ir_value(loc=loc, ip=ip)]
    old = Int64(llvm.inline_asm(Int64.mlir_type, values,
                                "atom.relaxed.gpu.global.add.u64 $0, [$1], $2;", "=l,l,l,~{memory}",
                                has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT,
                                loc=loc, ip=ip))
    return Uint32(old & Int64(0xFFFFFFFF)), Uint32(old >> 32)


@_op
def count_word(address, *, loc=None, ip=None):
    """Adds 1 to the word at ``address``; the issuing thread does not wait for it."""
    _asm("red.relaxed.gpu.global.add.u32 [$0], 1;", "l,~{memory}", [Int64(address)], 0, True,
         loc, ip)


@_op
def store_shared_word(shared, word, *, loc=None, ip=None):
    _asm("st.shared.u32 [$0], $1;", "r,r,~{memory}", [Int32(shared), Uint32(word)], 0, True,
         loc, ip)


@_op
def load_shared_word(shared, *, loc=None, ip=None):
    (word,) = _asm("ld.shared.u32 $0, [$1];", "=r,r,~{memory}", [Int32(shared)], 1, True,
                   loc, ip)
    return word


@_op
def await_word(address, value, budget, *, loc=None, ip=None):
    """1 once the word at ``address`` equals ``value``, 0 after ``budget`` ns: one loop in
    PTX, so the compiler keeps nothing of the caller's live across it."""
    code = ("{ .reg .pred p; .reg .u32 w; .reg .u64 t, due; mov.u64 due, %globaltimer; "
            "add.u64 due, due, $3; "
            "Lpoll${:uid}: ld.volatile.global.u32 w, [$1]; setp.eq.u32 p, w, $2; "
            "@p bra Ldone${:uid}; mov.u64 t, %globaltimer; setp.lt.u64 p, t, due; "
            "@p bra Lpoll${:uid}; Ldone${:uid}: selp.u32 $0, 1, 0, p; }")
    (out,) = _asm(code, "=r,l,r,l,~{memory}", [Int64(address), Uint32(value), Int64(budget)],
                  1, True, loc, ip)
    return out


@_op
def grid_size(*, loc=None, ip=None):
    """``%nctaid.x``, read where used, not held in a register from the kernel's start."""
    (out,) = _asm("mov.u32 $0, %nctaid.x;", "=r,~{memory}", [], 1, True, loc, ip)
    return Int32(out)


@_op
def barrier_any(flag, *, loc=None, ip=None):
    """A CTA barrier (barrier 0) returning 1 if ``flag`` was non-zero in any thread."""
    code = ("{ .reg .pred p, q; setp.ne.u32 p, $1, 0; bar.red.or.pred q, 0, p; "
            "selp.u32 $0, 1, 0, q; }")
    (out,) = _asm(code, "=r,r,~{memory}", [Int32(flag)], 1, True, loc, ip)
    return out


@_op
def atomic_max_word_sys(address, value, *, loc=None, ip=None):
    _asm("atom.sys.global.max.u32 $0, [$1], $2;", "=r,l,r,~{memory}",
         [Int64(address), Uint32(value)], 1, True, loc, ip)


@_op
def fence_sys(*, loc=None, ip=None):
    _asm("fence.sc.sys;", "~{memory}", [], 0, True, loc, ip)


@_op
def fence_acq_rel_sys(*, loc=None, ip=None):
    """Release for this thread's later strong stores, acquire for its earlier strong
    loads, towards every thread of the system (peer GPUs, host)."""
    _asm("fence.acq_rel.sys;", "~{memory}", [], 0, True, loc, ip)


@_op
def fence_acq_rel_gpu(*, loc=None, ip=None):
    _asm("fence.acq_rel.gpu;", "~{memory}", [], 0, True, loc, ip)


@_op
def trap(*, loc=None, ip=None):
    """Stops the kernel and the process's CUDA context: every later stream operation
    (the engine's copy of this step's tokens) raises."""
    _asm("trap;", "~{memory}", [], 0, True, loc, ip)


@_op
def scrub(word, *, loc=None, ip=None):
    """``word``, or 0 where it is the sentinel. An integer compare: a float compare takes
    (+0, -0) for zero, and ftz could flush denormal pairs to it."""
    code = ("{ .reg .pred s; setp.eq.u32 s, $1, " + hex(SENTINEL) + "; "
            "selp.u32 $0, 0, $1, s; }")
    (out,) = _asm(code, "=r,r", [Uint32(word)], 1, False, loc, ip)
    return out


@_op
def opaque(value, *, loc=None, ip=None):
    """``value``, opaque to the compiler: what derives from it is recomputed here
    instead of held in registers since."""
    (out,) = _asm("mov.b32 $0, $1;", "=r,r,~{memory}", [Int32(value)], 1, True, loc, ip)
    return Int32(out)


def armed(words):
    """Number of sentinel words among ``words`` (0: the fragment has arrived)."""
    count = Int32(0)
    for w in words:
        count = count + Int32(Uint32(w) == Uint32(SENTINEL))
    return count
