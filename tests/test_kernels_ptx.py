"""Every kernel variant cross-compiles on the CPU for every supported architecture
(``kernels.arch.ARCHS``: A100 to B300); its PTX moves mailbox data in 16-byte
system-scope stores and volatile polls, bounds its spin with the global timer, and
never uses multicast; PDL exactly where the architecture has it.

One compiled kernel serves both ways to give up: ``serving`` is a launch argument
(``launch.PARAMS``). The audits of one mode walk the instructions reachable with that
value of the argument (``_reachable``: the branches on it evaluated), so each mode is
pinned to what its compile-time variant was, and the trap is unreachable with 0.

The all-to-all mode (``compile_all_to_all``) is the same kernel addressed by rank: it
passes the same audits (``_A2A_VARIANTS``) but for one peer store per fragment in
flight (each fragment has one destination), with the row offsets as its last
parameters (``launch.ALL_TO_ALL_PARAMS``)."""

import functools
import re
import struct

import pytest

from lamport_head.kernels import ARCHS, compile_all_to_all, compile_gather, has_pdl
from lamport_head.kernels.protocol import DEFAULT_UNROLL, NAN_PAIR, SHARED_CONTROL_BYTES, staged


# The all-to-all's token (``steps.push_token``): a system-scope 16-byte store of one
# register in every word; a data push stores four words of a fragment
_TOKEN = re.compile(r"^(?:@!?%p\d+\s+)?st\.relaxed\.sys\.global\.v4\.u32\s+\[[^\]]+\],\s*"
                    r"\{\s*(%r\d+)\s*,\s*\1\s*,\s*\1\s*,\s*\1\s*\};")


def _data_pushes(ins):
    """Indices of the peer pushes of data in ``ins``: the system-scope 16-byte stores
    but the all-to-all's token."""
    return [i for i, t in enumerate(ins)
            if t.startswith("st.relaxed.sys.global.v4") and not _TOKEN.match(t)]


def _ops(ptx):
    return set(re.findall(r"\b(?:st|ld|multimem)\.[a-z0-9.:]+", ptx))


def _audit(k, tp, unroll, arch, staged=False, all_to_all=False):
    """What every compiled variant's PTX must show."""
    ops = _ops(k.ptx)
    assert f".target {arch}" in k.ptx
    assert "st.relaxed.sys.global.v4.u32" in ops  # peer pushes
    if staged:  # first reads of a batch through L2 into shared memory, 16 bytes each;
        # the fragments still armed are polled again with the volatile load
        assert "ld.volatile.global.v4.u32" in ops and "ld.global.v4.u32" not in ops
        assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16;", k.ptx)
        assert "cp.async.wait_all" in k.ptx and "ld.shared.v4.u32" in ops
        assert k.smem == SHARED_CONTROL_BYTES + 16 * unroll * k.threads
    else:
        assert "ld.volatile.global.v4.u32" in ops  # own-box polls
        assert k.smem == SHARED_CONTROL_BYTES  # the epoch's broadcast word
    assert "st.global.v4.u32" in ops  # output and re-arm
    assert not any("multimem" in op for op in ops) and "multimem" not in k.ptx
    assert "%globaltimer" in k.ptx  # bounded spin
    assert "ld.volatile.global.u32" in ops  # the fail-stop mark is polled from memory
    assert "st.relaxed.sys.global.u32" in ops and "fence.sc.sys" in k.ptx  # record, fence, flag
    assert "atom.relaxed.gpu.global.add.u64" in k.ptx  # the epoch's ticket
    assert "red.relaxed.gpu.global.add.u32" in k.ptx  # the done count
    assert str(NAN_PAIR) in k.ptx or hex(NAN_PAIR) in k.ptx.lower()  # missing -> NaN
    assert ("griddepcontrol.wait" in k.ptx) == has_pdl(arch)  # PDL where the arch has it
    # every push is one 16-byte store per peer per fragment in flight (the all-to-all:
    # per fragment in flight, to its one destination, and its token: one more, of the
    # same system-scope kind, one register in all four words: the epoch)
    pushes = unroll if all_to_all else unroll * (tp - 1)
    tokens = [t for t in _instructions(k.ptx) if _TOKEN.match(t)]
    assert len(tokens) == (1 if all_to_all else 0), tokens
    assert len(re.findall(r"st\.relaxed\.sys\.global\.v4\.u32", k.ptx)) == pushes + len(tokens)
    assert k.all_to_all == all_to_all
    assert k.cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("threads,unroll", [(128, 2), (256, 4), (512, 8)])
def test_variant_ptx(tp, threads, unroll):
    _audit(compile_gather(tp, 163840 // tp // 2, threads=threads, unroll=unroll), tp, unroll,
           "sm_90a", staged(unroll))


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("threads,unroll", [(256, 4), (256, 8), (512, 8)])
def test_staged_variant_ptx(tp, threads, unroll):
    """The staged variant (batches through shared memory) keeps every mailbox access
    of the audit; only the loads into a batch change (``cp.async``), and its launch
    asks one 16-byte slot of shared memory per fragment in flight. It is what unroll
    8 and more compile to by default, never 4 and less."""
    assert staged(unroll) == (unroll >= 8) and not staged(4) and staged(16)
    k = compile_gather(tp, 163840 // tp // 2, threads=threads, unroll=unroll, staged=True)
    assert k is not compile_gather(tp, 163840 // tp // 2, threads=threads, unroll=unroll,
                                   staged=False)
    _audit(k, tp, unroll, "sm_90a", staged=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_architecture_compiles_with_the_defaults_and_passes_the_audit(arch, tp):
    """``compile_gather(tp, shard_words, arch=ARCH)`` with every other argument at its
    default: A100 (sm_80, no PDL) to B300 (sm_103a); one kernel, both give-ups: the
    trap is reached only when launched serving."""
    k = compile_gather(tp, 163840 // tp // 2, arch=arch)
    _audit(k, tp, 4, arch, staged(4))
    assert len(re.findall(r"\btrap;", k.ptx)) == 1
    assert [_traps(k, serving) for serving in (0, 1)] == [0, 1]


def test_pdl_before_hopper_is_refused_in_one_line():
    with pytest.raises(ValueError, match="sm_80 has no programmatic dependent launch"):
        compile_gather(2, 512, arch="sm_80", pdl=True)
    assert has_pdl("sm_90a") and has_pdl("sm_100a") and not has_pdl("sm_89")


def test_without_pdl_no_griddepcontrol():
    k = compile_gather(4, 1024, pdl=False)  # sm_90a with PDL switched off
    assert "griddepcontrol" not in k.ptx


def test_compile_cache_and_validation():
    assert compile_gather(2, 512) is compile_gather(2, 512)
    with pytest.raises(ValueError, match="tp"):
        compile_gather(1, 512)
    with pytest.raises(ValueError, match="tp"):
        compile_gather(33, 512)  # the control block holds one word per rank, up to MAX_TP
    with pytest.raises(ValueError, match="multiple of 4 words"):
        compile_gather(2, 510)
    with pytest.raises(ValueError, match="threads"):
        compile_gather(2, 512, threads=96)
    with pytest.raises(ValueError, match="unroll"):
        compile_gather(2, 512, unroll=0)


def test_one_kernel_serves_both_modes():
    """Issue 30 item 2: no compile key names a mode (the tuner times the cubin serving
    launches); ``serving`` is the kernel's last parameter, 32 bits, which the driver
    launcher writes (``launch.PARAMS``)."""
    import inspect

    from lamport_head.launch import PARAMS, _Values

    assert "stop" not in inspect.signature(compile_gather).parameters
    with pytest.raises(TypeError):
        compile_gather(2, 512, stop=True)
    assert PARAMS[-1][0] == "serving" and hasattr(_Values, "serving")
    k = compile_gather(2, 512)
    assert k is compile_gather(2, 512)
    names = re.findall(r"\.param\s+\.\w+\s+(\w+)", _ENTRY_PARAMS.search(k.ptx).group(1))
    assert len(names) == len(PARAMS) and _serving_param(k.ptx) == names[-1]


@pytest.mark.parametrize("tp", [2, 8])
def test_the_trap_follows_the_record_and_is_reachable_only_when_serving(tp):
    """Launched serving, a give-up ends in ``trap``, after the flag's store and a fence;
    launched with 0 (recoverable: NaN, raise, reset) no path reaches the trap: every
    path to it passes a branch on a predicate computed from the ``serving`` parameter
    (``_reachable`` finds none with 0, one with 1)."""
    k = compile_gather(tp, 163840 // tp // 2)
    assert len(re.findall(r"\btrap;", k.ptx)) == 1
    assert _traps(k, 0) == 0 and _traps(k, 1) == 1
    serving = _mode(k, 1)
    body = serving[:serving.index("trap;")]
    last_flag = max(i for i, t in enumerate(body) if t.startswith("st.relaxed.sys.global.u32"))
    assert "fence.sc.sys;" in body[last_flag:]  # record, fence, flag, fence, trap
    assert "multimem" not in k.ptx and "%globaltimer" in k.ptx


@pytest.mark.parametrize("tp", [2, 8])
def test_the_prologue_before_the_pdl_wait_reads_only_the_peer_table(tp):
    """Issue 21 item 3: whatever does not depend on the previous kernel comes before
    ``griddepcontrol.wait``: every peer-table load the call needs (own control block,
    each rank's parity-0 box, own parity-1 box: tp + 2). Nothing that the previous
    kernel or gather writes (shard, epoch, mark: plain and volatile 32-bit or 128-bit
    loads) is read before it. After it, the table is read only on the give-up path
    (``mark_peers``: every rank's control block, loaded where it is used; the
    compiler may share the two loops' loads), never held in registers through the
    poll loop."""
    k = compile_gather(tp, 163840 // tp // 2, arch="sm_90a")
    before, after = k.ptx.split("griddepcontrol.wait", 1)
    assert before.count("ld.global.b64") == tp + 2
    assert tp <= after.count("ld.global.b64") <= 2 * tp
    assert not re.search(r"\bld\.(?:volatile\.)?global\.(?:v4\.)?u32", before)


def test_the_phase_timers_are_a_diagnostic_variant_only():
    """``timers=True`` (benches/diagnostics/phases.py) stamps the global timer at each
    of the protocol's phase boundaries; the variants the runtime builds read it only
    where they did (the start and the bounded waits)."""
    from lamport_head.kernels.protocol import TIMER_PHASES

    plain = compile_gather(8, 163840 // 8 // 2, arch="sm_90a")
    timed = compile_gather(8, 163840 // 8 // 2, arch="sm_90a", timers=True)
    assert timed is not plain and timed is compile_gather(8, 163840 // 8 // 2, timers=True)
    extra = timed.ptx.count("%globaltimer") - plain.ptx.count("%globaltimer")
    assert extra == len(TIMER_PHASES)


def test_the_driver_launchers_slots_are_the_kernels_parameters():
    """``DriverLaunch`` writes its argument slots in ``launch.PARAMS`` order; the PTX
    entry of every compiled variant must have exactly those widths, and a kernel whose
    signature changed is refused when the launcher is built."""
    import ctypes

    from lamport_head.launch import PARAMS, _Attribute, _Config, kernel_entry

    for arch in ARCHS:
        assert kernel_entry(compile_gather(8, 10240, arch=arch).ptx)
    ptx = compile_gather(2, 1024).ptx
    assert kernel_entry(ptx) in ptx
    dropped = ptx.replace(".param .u32", ".param .u64", 1)  # rows widened
    with pytest.raises(ValueError, match="widths"):
        kernel_entry(dropped)
    with pytest.raises(ValueError, match="one .entry"):
        kernel_entry(ptx + ptx)
    assert [n for n, _ in PARAMS] == ["shard", "rows", "out", "peers", "rank", "budget", "status",
                                      "serving"]
    # cuda.h's CUlaunchConfig and CUlaunchAttribute (x86-64): the driver reads these bytes
    assert ctypes.sizeof(_Attribute) == 72 and _Attribute.value.offset == 8
    assert ctypes.alignment(_Attribute) == 8  # the union holds 64-bit members
    pdl = _Attribute(id=6)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    pdl.value.programmaticStreamSerializationAllowed = 1
    assert bytes(pdl)[:12] == (6).to_bytes(4, "little") + bytes(4) + (1).to_bytes(4, "little")
    assert (_Config.sharedMemBytes.offset, _Config.hStream.offset, _Config.attrs.offset,
            _Config.numAttrs.offset, ctypes.sizeof(_Config)) == (24, 32, 40, 48, 56)


def _instructions(ptx):
    """The PTX's instructions in order (labels kept as ``NAME:``), comments and
    directives dropped: what the order assertions walk."""
    out = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].strip()
        if line.startswith("{") and line.endswith("}"):  # an inline-asm block on one line:
            pieces = line[1:-1].split(";")  # its statements, labels apart, declarations out
        else:
            pieces = [line[:-1]] if line.endswith(";") else [line]
        for piece in (p.strip() for p in pieces):
            while (label := re.match(r"^(\w+):\s*(.*)$", piece)) and label.group(2):
                out.append(label.group(1) + ":")
                piece = label.group(2)
            if not piece or piece.startswith((".", "{", "}")):
                continue
            out.append(piece if piece.endswith(":") else piece + ";")
    return out


_MEMORY = re.compile(r"^(?:@!?%p\d+\s+)?(?:ld(?!\.param)|st|atom|red|fence|cp\.async|bar|trap)\b")


_ENTRY_PARAMS = re.compile(r"\.entry\s+\w+\s*\(([^)]*)\)", re.S)
_COMPARE = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
            "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b}
_LOGIC = {"and": lambda a, b: a and b, "or": lambda a, b: a or b, "xor": lambda a, b: a != b}


def _serving_param(ptx):
    """The PTX name of the kernel's ``serving`` parameter (``launch.PARAMS``' place)."""
    from lamport_head.launch import PARAMS

    names = re.findall(r"\.param\s+\.\w+\s+(\w+)", _ENTRY_PARAMS.search(ptx).group(1))
    return names[[n for n, _ in PARAMS].index("serving")]


def _split(t):
    """``(guard, opcode, operands)`` of one instruction; guard ``(negated, predicate)``."""
    guard = None
    m = re.match(r"@(!?)(%\w+)\s+", t)
    if m:
        guard, t = (m.group(1) == "!", m.group(2)), t[m.end():]
    opcode, _, rest = re.sub(r"\s+", " ", t.rstrip(";")).partition(" ")
    return guard, opcode, [o.strip() for o in re.split(r",(?![^{]*})", rest) if o.strip()]


def _value(opcode, ops, of, param, serving):
    """The set of values one definition can give its register, from its operands'
    (``of``); None: unknown (a load, arithmetic: anything but the ``serving``
    parameter, a constant, a copy, a select or a comparison of known values)."""
    head = opcode.split(".")[0]
    if opcode.startswith("ld.param"):
        return {serving} if ops[1] == f"[{param}]" else None
    if head in ("mov", "cvt") and len(ops) == 2:
        return of(ops[1])
    if head == "selp":
        a, b, p = of(ops[1]), of(ops[2]), of(ops[3])
        if p == {True}:
            return a
        if p == {False}:
            return b
        return None if a is None or b is None or p is None else a | b
    if head == "setp" and len(ops) == 3 and opcode.split(".")[1] in _COMPARE:
        a, b = of(ops[1]), of(ops[2])
        cmp = _COMPARE[opcode.split(".")[1]]
        return None if a is None or b is None else {cmp(x, y) for x in a for y in b}
    if head in _LOGIC and opcode.endswith(".pred"):
        a, b = of(ops[1]), of(ops[2])
        if head == "and" and {False} in (a, b):
            return {False}
        if head == "or" and {True} in (a, b):
            return {True}
        return None if a is None or b is None else {
            _LOGIC[head](bool(x), bool(y)) for x in a for y in b}
    if opcode == "not.pred":
        a = of(ops[1])
        return None if a is None else {not x for x in a}
    return None


@functools.lru_cache(maxsize=None)
def _reachable(ptx, serving):
    """Indices of ``_instructions(ptx)`` a launch with ``serving`` can run: sparse
    conditional constant propagation, flow-insensitive over the definitions reached so
    far (each register's values: the union over its reachable definitions), and a
    branch goes only where its predicate's values send it (nowhere yet while none is
    known). Optimistic, grown to a fixpoint: every instruction a real launch runs is
    in the set."""
    ins = _instructions(ptx)
    param = _serving_param(ptx)
    parsed = [_split(t) for t in ins]
    labels = {t[:-1]: i for i, t in enumerate(ins) if t.endswith(":")}
    values = {}  # register -> set of values, None (unknown); absent: no definition reached

    def defines(opcode, ops):
        return (ops and re.fullmatch(r"[{%][\w%, |{}]*", ops[0])
                and not opcode.startswith(("st.", "bra")))

    defined = {reg for _, opcode, ops in parsed if defines(opcode, ops)
               for reg in re.findall(r"%\w+", ops[0])}

    def of(operand):
        if operand.startswith("%"):  # a special register (%tid.x, ...): unknown
            return values.get(operand, set()) if operand in defined else None
        try:
            return {int(operand, 0)}
        except ValueError:
            return None

    seen = set()
    while True:
        todo, walked = [0], set()
        while todo:
            i = todo.pop()
            if i in walked or i >= len(ins):
                continue
            walked.add(i)
            guard, opcode, ops = parsed[i]
            ways = {True, False}  # taken, not taken: unguarded, or not known
            if guard is not None:
                known = values.get(guard[1], set())
                if known is not None:
                    ways = {bool(v) != guard[0] for v in known}
            if opcode.startswith("bra"):
                if True in ways:
                    todo.append(labels[ops[0]])
                if guard is not None and False in ways:
                    todo.append(i + 1)
            elif opcode in ("ret", "exit", "trap"):
                if guard is not None and False in ways:
                    todo.append(i + 1)
            elif guard is None or ways:
                todo.append(i + 1)
        changed = walked != seen
        seen = walked
        grown = True
        while grown:
            grown = False
            for i in sorted(seen):
                opcode, ops = parsed[i][1:]
                if not defines(opcode, ops):
                    continue
                regs = re.findall(r"%\w+", ops[0])
                new = _value(opcode, ops, of, param, serving) if [ops[0]] == regs else None
                for reg in regs:
                    old = values.get(reg, set())
                    merged = None if old is None or new is None else old | new
                    if merged != old:
                        values[reg], grown, changed = merged, True, True
        if not changed:
            return sorted(seen)


def _mode(k, serving):
    """The instructions of ``k`` a launch with ``serving`` can run, in order."""
    ins = _instructions(k.ptx)
    return [ins[i] for i in _reachable(k.ptx, serving)]


def _traps(k, serving):
    return sum(t.startswith(("trap", "@")) and t.endswith("trap;") for t in _mode(k, serving))


def _memory_ops(ins):
    """Indices and text of the memory instructions (and fences, barriers, trap); the
    kernel's parameters (``ld.param``) are not memory the protocol orders."""
    return [(i, t) for i, t in enumerate(ins) if _MEMORY.match(t)]


def registers(cubin: bytes) -> int:
    """Registers per thread of the cubin's one kernel: ``EIATTR_REGCOUNT`` (0x2f) of
    its ``.nv.info`` section (what ``cuobjdump -res-usage`` prints as REG)."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2  # ELF64
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    table = headers[names][4]
    for header in headers:
        start = table + header[0]
        if cubin[start:cubin.index(b"\0", start)].startswith(b".nv.info"):
            data, i = cubin[header[4]:header[4] + header[5]], 0
            while i + 2 <= len(data):
                form, attribute = data[i], data[i + 1]
                if form == 4:  # EIFMT_SVAL: a 16-bit size, then the value
                    (size,) = struct.unpack_from("<H", data, i + 2)
                    if attribute == 0x2F:  # EIATTR_REGCOUNT: symbol, count
                        return struct.unpack_from("<II", data, i + 4)[1]
                    i += 4 + size
                else:
                    i += 2 if form == 1 else 4
    raise AssertionError("no EIATTR_REGCOUNT in the cubin")


# every mode of every kernel below: (tp, unroll, serving, arch); the audits walk the
# instructions a launch with that ``serving`` can run (``_mode``)
_FENCE_VARIANTS = [(tp, unroll, serving, arch) for arch in ("sm_90a", "sm_80") for tp in (2, 8)
                   for unroll in (4, 8) for serving in (0, 1)]
# the same modes of the all-to-all: every audit below runs on both kernels
_BOTH = [(*v, False) for v in _FENCE_VARIANTS] + [(*v, True) for v in _FENCE_VARIANTS]


def _kernel(tp, unroll, arch, all_to_all):
    """The audited kernel of the full-width shard (V = 163840) of ``tp`` ranks."""
    return compile_gather(tp, 163840 // tp // 2, unroll=unroll, arch=arch, all_to_all=all_to_all)


@pytest.mark.parametrize("tp,unroll,serving,arch,all_to_all", _BOTH)
def test_no_system_fence_before_the_pushes_the_kernel_boundary_orders_the_rearms(
        tp, unroll, serving, arch, all_to_all):
    """Issue 28 item 4, the re-arm: ordered before a peer's push into the same parity two
    calls later by the kernel boundary (PDL's wait, stream order), with no fence on the
    critical path: a ``fence.acq_rel.sys`` after the wait, measured on the H200, cost TP 8
    M = 1 7.31 -> 10.62 µs and TP 2 4.09 -> 5.70 (docs/figures.md). Pinned: nothing
    of the call's protocol but the epoch's ticket (mailbox loads, stores) comes before
    PDL's wait, and no system fence comes between the wait and the first push."""
    k = _kernel(tp, unroll, arch, all_to_all)
    ins = _mode(k, serving)
    first_push = next(i for i, t in enumerate(ins) if t.startswith("st.relaxed.sys.global.v4"))
    start = ins.index("griddepcontrol.wait;") if has_pdl(arch) else 0
    before = [t for _, t in _memory_ops(ins[:start])]
    # the peer table, and the epoch's ticket (``take_epoch``) broadcast to the CTA
    assert all(t.startswith(("ld.global.b64", "atom.relaxed.gpu.global.add.u64", "st.shared.u32",
                             "ld.shared.u32", "bar.sync"))
               for t in before), before
    assert not any(t.startswith(("fence.acq_rel.sys", "fence.sc.sys", "membar.sys"))
                   for t in ins[start:first_push])


def _guarded(ins, i, j):
    """Whether instruction ``i`` sits in a branch that jumps past it before ``j``: a
    conditional ``bra`` before ``i`` to a label between ``i`` and ``j``."""
    labels = {t[:-1] for t in ins[i:j] if t.endswith(":")}
    return any(re.match(rf"@!?%p\d+\s+bra(?:\.uni)?\s+({'|'.join(map(re.escape, labels))});", t)
               for t in ins[:i]) if labels else False


@pytest.mark.parametrize("tp,unroll,serving,arch,all_to_all", _BOTH)
def test_the_epoch_is_a_ticket_and_a_cta_fences_only_what_it_reports(
        tp, unroll, serving, arch, all_to_all):
    """Issue 51 item 2, ``steps.take_epoch`` and ``steps.finish``. The epoch is one
    atomic add to the ticket pair, before PDL's wait (hidden behind the previous
    kernel's tail); the launch's last ticket moves the pair on with a second atomic
    (a third at the span's end) whose result is read before the barrier, so it is
    performed before the CTA lets the next launch start, and the epoch reaches the
    CTA's threads through shared memory across that barrier; the next parity's done
    count is cleared after the wait, when the previous launch has ended. At the end one
    barrier reduction tells whether any thread of the CTA has something to report (two
    more, in a branch on it, say what), then thread 0 counts the CTA done with a
    ``red`` (no return: nobody waits on it); the release ``fence.acq_rel.gpu`` before
    it sits in a branch (a CTA with nothing to report skips it), and the only other
    fence of the gpu scope is the acquire of the heartbeat's clear, after the count and
    before the mark's read. No atomic with a return value at the end."""
    k = _kernel(tp, unroll, arch, all_to_all)
    ins = _mode(k, serving)
    tickets = [i for i, t in enumerate(ins) if t.startswith("atom.relaxed.gpu.global.add.u64")]
    assert len(tickets) == 3  # the ticket; the last one's move and the span's wrap
    barrier = next(i for i in range(tickets[0], len(ins)) if ins[i].startswith("bar.sync"))
    assert tickets[-1] < barrier
    texts = [t for _, t in _memory_ops(ins[tickets[-1] + 1:barrier])]
    assert sum(t.startswith("st.shared.u32") for t in texts) == 2  # the epoch; the move, read
    assert not any(t.startswith(("st.global", "ld.global")) for t in texts)
    assert any(t.startswith("ld.shared.u32") for t in ins[barrier:barrier + 8])
    if has_pdl(arch):  # all before the wait, and the wait before the trigger
        start = ins.index("griddepcontrol.wait;")
        assert barrier < start < ins.index("griddepcontrol.launch_dependents;")
    # the next launch's done count cleared after the wait, before the first push
    start = ins.index("griddepcontrol.wait;") if has_pdl(arch) else barrier
    clears = [i for i, t in enumerate(ins[start:_data_pushes(ins)[0]])
              if t.startswith("st.global.u32")]
    assert len(clears) == 1
    counts = [i for i, t in enumerate(ins) if t.startswith("red.relaxed.gpu.global.add.u32")]
    assert len(counts) == 1
    count = counts[0]
    reductions = [i for i, t in enumerate(ins[:count]) if "bar.red.or.pred" in t]
    assert len(reductions) == 3  # whether anything; then which, in a branch on the first
    assert _guarded(ins, reductions[1], count) and not _guarded(ins, reductions[0], count)
    fences = [i for i, t in enumerate(ins) if t == "fence.acq_rel.gpu;"]
    assert len(fences) == 2
    release, acquire = fences
    assert reductions[-1] < release < count < acquire
    assert _guarded(ins, release, count)
    ops = [t for _, t in _memory_ops(ins[release + 1:count])]
    assert ops == [], ops  # the release, then the count
    assert ins[acquire + 1:].index(next(t for t in ins[acquire + 1:]
                                       if t.startswith("ld.volatile.global.u32"))) < 8
    assert not any(t.startswith("atom.global.add") for t in ins[reductions[0]:])


@pytest.mark.parametrize("tp,unroll,serving,arch,all_to_all", _BOTH)
def test_the_record_reads_the_missing_ranks_only_after_an_acquire(
        tp, unroll, serving, arch, all_to_all):
    """Issue 28 item 4, ``write_record``: the status record (missing ranks, epoch,
    ``fence.sc.sys``, flag) reads the tp missing-rank words of the control block only
    after a ``fence.acq_rel.sys`` that follows the mark's read: the record is in every
    mode once (recoverable: ``publish``; serving: ``record_and_stop``)."""
    k = _kernel(tp, unroll, arch, all_to_all)
    ops = [t for _, t in _memory_ops(_mode(k, serving))]
    flags = [n for n in range(1, len(ops) - 1) if ops[n] == "fence.sc.sys;"
             and ops[n + 1].startswith("st.relaxed.sys.global.u32")
             and ops[n - 1].startswith("st.relaxed.sys.global.u32")]
    assert len(flags) == 1  # the record's fence before its flag, once
    start = max(n for n in range(flags[0]) if ops[n].startswith("fence"))
    assert ops[start] == "fence.acq_rel.sys;"
    record = ops[start + 1:flags[0]]
    assert sum(t.startswith("ld.volatile.global.u32") for t in record) == tp
    assert all(t.startswith(("ld.volatile.global.u32", "st.relaxed.sys.global.u32"))
               for t in record), record
    assert ops[start - 1].startswith("ld.volatile.global.u32")  # the mark, read before


# Registers per thread (sm_90a, 256 threads): the audit's ceiling, so a change that
# costs a CTA per SM fails here. Registers are allocated per warp in units of 256,
# 8 per thread, so the ceiling is on that allocation (64 x 256 threads: 4 CTAs per
# SM; 72: 3). Measured on 0a45b23 (recoverable, serving): TP 8 unroll 4: 64, 66;
# unroll 8 (staged): 58, 58; TP 2 unroll 4: 54, 56; unroll 8: 40, 46. With the
# fences of issue 28 and the heartbeats of issue 29: TP 8 unroll 4: 64, 64; unroll
# 8: 58, 64; TP 2 unroll 4: 54, 56; unroll 8: 40, 46. One kernel for both modes
# (issue 30 item 2: ``serving`` a launch argument): TP 8 unroll 4: 64; unroll 8: 64;
# TP 2 unroll 4: 58; unroll 8: 50 (the serving variant's 56 and 46 before: TP 2's
# allocation rises by 8; at 256 threads unroll 4 keeps 4 CTAs per SM, unroll 8
# (staged, 32 KiB of slots) goes from 5 to 4). The epoch a ticket, the CTA count a
# ``red`` (issue 51): TP 8 64, 64; TP 2 58, 52; the ticket before PDL's wait: the same.
# A batch's loads issued together (predicated, the mark beside them): TP 8 64, 64;
# TP 2 64, 52.
REGISTER_CEILING = {(8, 4): 64, (8, 8): 64, (2, 4): 64, (2, 8): 56}


def _assert_within(compile_fn, ceiling, tp, unroll):
    """The kernel's registers, allocated in the hardware's granules of 8, within its
    ceiling (sm_90a, V = 163840)."""
    k = compile_fn(tp, 163840 // tp // 2, unroll=unroll, arch="sm_90a")
    allocated = -(-registers(k.cubin) // 8) * 8
    assert allocated <= ceiling[tp, unroll], registers(k.cubin)


@pytest.mark.parametrize("tp,unroll", sorted(REGISTER_CEILING))
def test_registers_stay_within_the_ceiling(tp, unroll):
    _assert_within(compile_gather, REGISTER_CEILING, tp, unroll)


def _heartbeat_at(ins, i):
    """Whether ``ins[i:]`` opens with serving's heartbeat check: the global timer, then
    (before any other memory access) the host's ``STATUS_SLOW`` store."""
    if "%globaltimer" not in ins[i]:
        return False
    ops = [t for _, t in _memory_ops(ins[i + 1:])][:1]
    return len(ops) == 1 and ops[0].startswith("st.relaxed.sys.global.u32")


@pytest.mark.parametrize("tp,unroll,serving,arch,all_to_all", _BOTH)
def test_serving_raises_the_heartbeat_before_every_step_that_can_stall(
        tp, unroll, serving, arch, all_to_all):
    """Issue 29 item 2 (kernel side): the serving variant raises the slow heartbeat
    (``steps.heartbeat``: past half the budget, once per thread) before each push
    batch after the first (inside the push loop, before its system-scope stores),
    after each poll that left fragments dirty, and in thread 0 before the CTA's done
    count (``steps.finish``); a CTA's give-up raises it before the record's fences
    whatever the time, and the give-up's marks write the missing ranks into
    the host record before any store into a peer. A recoverable launch runs none of
    it."""
    k = _kernel(tp, unroll, arch, all_to_all)
    ins = _mode(k, serving)
    rearm = ins.index("griddepcontrol.wait;") if has_pdl(arch) else 0
    pushes = _data_pushes(ins)  # the token (all-to-all): one store, before them, at the start
    first_push = pushes[0]
    beats = [i for i in range(rearm, first_push) if _heartbeat_at(ins, i)]
    assert len(beats) == (1 if serving else 0)
    if serving:  # inside the push loop: the loop's back edge jumps to a label before it
        label = next(ins[i][:-1] for i in range(beats[0], rearm, -1) if ins[i].endswith(":"))
        assert any(re.search(rf"\bbra(?:\.uni)?\s+{re.escape(label)};", t)
                   for t in ins[pushes[-1]:])
    polls = [i for i in range(first_push, len(ins)) if _heartbeat_at(ins, i)]
    assert len(polls) == (2 if serving else 0)  # the poll loop's and thread 0's before the count
    ops = _memory_ops(ins)
    texts = [t for _, t in ops]
    count = texts.index(next(t for t in texts if t.startswith("red.relaxed.gpu.global.add.u32")))
    barrier = max(n for n in range(count) if texts[n].startswith("bar.red"))
    assert any(_heartbeat_at(ins, i) for i in range(ops[barrier][0], ops[count - 1][0])) == serving
    record = texts.index("fence.acq_rel.sys;")
    if serving:  # the give-up's heartbeat, after the count, before the record
        assert count < record
        assert any(t.startswith("st.relaxed.sys.global.u32") for t in texts[count:record])
    # the give-up's marks: the host record's missing ranks (serving) before every store
    # into the control blocks, the fence, then the marks
    marks = texts.index(next(t for t in texts if t.startswith("atom.sys.global.max")))
    assert texts[marks - 1] == "fence.sc.sys;"
    last_delivery = max(n for n in range(marks) if texts[n].startswith("st.global.v4"))
    stores = [t for t in texts[last_delivery:marks] if t.startswith("st.relaxed.sys.global.u32")]
    assert len(stores) == tp * tp + (tp if serving else 0)


# The candidate gathers' shard widths (issue 32 item 2, ``lamport_head.candidates``):
# vLLM's get_top_tokens pairs (8 BF16 a rank: one fragment per row), its log-partition
# (8) and get_top_k_tokens' int64 ids for k = 2 (32 BF16: 16 words)
CANDIDATE_WORDS = (4, 16)


@pytest.mark.parametrize("words", CANDIDATE_WORDS)
@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_candidate_widths_compile_and_pass_the_audit(words, tp, arch):
    """The small payloads go through the same kernel at a width of a few fragments a
    row: it compiles there, passes every audit of the full-width kernel, and keeps
    the trap reachable only when launched serving."""
    k = compile_gather(tp, words, arch=arch)
    _audit(k, tp, DEFAULT_UNROLL, arch, staged(DEFAULT_UNROLL))
    assert _traps(k, 0) == 0 and _traps(k, 1) == 1
    for serving in (0, 1):
        ops = [t for _, t in _memory_ops(_mode(k, serving))]
        assert ops.count("fence.acq_rel.gpu;") == 2  # a report's release, the heartbeat's acquire


# FP32 logits (issue 42): the kernel moves 32-bit words whatever the values, so an FP32
# row of V/TP values is V/TP words (``dtypes.words``), twice the BF16 row's: Kimi K2's V
# and Qwen's 151936.
FP32_VOCABS = (163840, 151936)


@pytest.mark.parametrize("vocab", FP32_VOCABS)
@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_fp32_widths_compile_and_pass_the_audit(vocab, tp, arch):
    """At the FP32 widths (``dtypes.words(V / TP, float32)`` = V / TP words a row) the
    kernel compiles, passes every audit of the BF16 widths, keeps the trap reachable
    only when launched serving, and is the same kernel as a BF16 row of twice the
    values (one compile key: words, not dtype)."""
    from lamport_head import dtypes

    words = dtypes.words(vocab // tp, "float32")
    assert words == vocab // tp == 2 * dtypes.words(vocab // tp, "bfloat16")
    k = compile_gather(tp, words, arch=arch)
    assert k is compile_gather(tp, dtypes.words(2 * (vocab // tp), "bfloat16"), arch=arch)
    _audit(k, tp, DEFAULT_UNROLL, arch, staged(DEFAULT_UNROLL))
    assert _traps(k, 0) == 0 and _traps(k, 1) == 1
    for serving in (0, 1):
        ops = [t for _, t in _memory_ops(_mode(k, serving))]
        assert ops.count("fence.acq_rel.gpu;") == 2  # a report's release, the heartbeat's acquire


# Registers of the all-to-all (sm_90a, 256 threads), allocated in units of 8 as above.
# Measured: TP 8 unroll 4: 72 (the gather's 64: its row offsets and the destination's
# choice per fragment; 3 CTAs per SM instead of 4 at 256 threads); unroll 8: 60; TP 2
# unroll 4: 60; unroll 8: 42. With the token (``push_token``, its box address loaded
# where it is pushed, the rank's rows computed after the pushes): TP 8 unroll 4: 66;
# unroll 8: 48; TP 2 unroll 4: 56; unroll 8: 44 (the selects over the held box
# addresses instead: 76, 64, 58, 40). The epoch a ticket, the CTA count a ``red`` (issue
# 51): 64, 48, 60, 50; the ticket before PDL's wait: 64, 48, 60, 50 (a stale-ticket
# give-up tried beside it, a flag broadcast through shared memory: 70, 58, 62, 48).
A2A_REGISTER_CEILING = {(8, 4): 72, (8, 8): 64, (2, 4): 64, (2, 8): 56}


@pytest.mark.parametrize("tp,unroll", sorted(A2A_REGISTER_CEILING))
def test_all_to_all_registers_stay_within_the_ceiling(tp, unroll):
    _assert_within(compile_all_to_all, A2A_REGISTER_CEILING, tp, unroll)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("unroll", [4, 8])
def test_the_all_to_all_compiles_and_passes_the_audit(arch, tp, unroll):
    """Issue 43 item 1: the all-to-all is the gather's kernel addressed by rank. Every
    audit of the gather holds (``_audit``), with one system-scope push per fragment in
    flight; one trap, reachable only when launched serving; the row offsets read by
    compile-time index (no local memory); its own cache entry, never the gather's."""
    k = compile_all_to_all(tp, 163840 // tp // 2, unroll=unroll, arch=arch)
    assert k is compile_gather(tp, 163840 // tp // 2, unroll=unroll, arch=arch, all_to_all=True)
    assert k is not compile_gather(tp, 163840 // tp // 2, unroll=unroll, arch=arch)
    _audit(k, tp, unroll, arch, staged(unroll), all_to_all=True)
    assert len(re.findall(r"\btrap;", k.ptx)) == 1
    assert [_traps(k, serving) for serving in (0, 1)] == [0, 1]
    assert "ld.local" not in k.ptx and "st.local" not in k.ptx


@pytest.mark.parametrize("words", CANDIDATE_WORDS)
@pytest.mark.parametrize("tp", [2, 8])
def test_the_all_to_all_compiles_at_the_candidate_widths(words, tp):
    """A row of a few fragments (one, four): the same audit, both modes."""
    k = compile_all_to_all(tp, words, arch="sm_90a")
    _audit(k, tp, DEFAULT_UNROLL, "sm_90a", staged(DEFAULT_UNROLL), all_to_all=True)
    assert _traps(k, 0) == 0 and _traps(k, 1) == 1


@pytest.mark.parametrize("tp", [2, 8])
def test_the_all_to_all_reads_its_offsets_only_after_the_pdl_wait_and_only_tp_plus_one(tp):
    """The offsets are parameters (``ld.param``), read where the call needs them; the
    prologue before PDL's wait is the gather's (the peer table, tp + 2 loads); of the
    ``MAX_TP + 1`` offset parameters only the first tp + 1 are ever loaded."""
    from lamport_head.launch import ALL_TO_ALL_PARAMS, PARAMS

    k = compile_all_to_all(tp, 163840 // tp // 2, arch="sm_90a")
    before, after = k.ptx.split("griddepcontrol.wait", 1)
    assert before.count("ld.global.b64") == tp + 2
    assert not re.search(r"\bld\.(?:volatile\.)?global\.(?:v4\.)?u32", before)
    names = re.findall(r"\.param\s+\.\w+\s+(\w+)", _ENTRY_PARAMS.search(k.ptx).group(1))
    assert len(names) == len(ALL_TO_ALL_PARAMS)
    offsets = names[len(PARAMS):]
    read = [i for i, name in enumerate(offsets) if re.search(rf"\[{name}\]", k.ptx)]
    assert read == list(range(tp + 1)) or read == list(range(1, tp + 1)), read


@pytest.mark.parametrize("tp,unroll,serving,arch", _FENCE_VARIANTS)
def test_the_all_to_all_token_is_the_epoch_in_one_system_scope_store_before_the_data(
        tp, unroll, serving, arch):
    """The zero-row race's fix (``steps.push_token``): a rank of 0 rows polls one token
    per peer, so every call waits on every peer. The token is pushed like data: one
    ``st.relaxed.sys.global.v4`` (the audit counts it), reachable in both modes, after
    PDL's wait and before the first data push (no system fence between: the kernel
    boundary orders the re-arms, as for data); its four words are the epoch's volatile
    from shared memory (``steps.take_epoch``'s broadcast; never the sentinel: below
    ``EPOCH_SPAN``), the register whose low bit is the parity; its box address a
    peer-table load. The gather has none."""
    k = _kernel(tp, unroll, arch, True)
    ins = _mode(k, serving)
    tokens = [i for i, t in enumerate(ins) if _TOKEN.match(t)]
    assert len(tokens) == 1
    token = tokens[0]
    start = ins.index("griddepcontrol.wait;") if has_pdl(arch) else 0
    assert start < token < _data_pushes(ins)[0]
    assert not any(t.startswith(("fence", "membar")) for t in ins[start:token])
    word = _TOKEN.match(ins[token]).group(1)
    defined = [t for t in ins[:token] if re.match(rf"\S+\s+{re.escape(word)},", t)]
    assert len(defined) == 1 and defined[0].startswith("ld.shared.u32"), defined
    assert any(re.match(rf"and\.b32\s+%r\d+,\s*{re.escape(word)},\s*1;", t) for t in ins)
    assert any(t.startswith("ld.global.b64") for t in ins[start:token])
    assert not any(_TOKEN.match(t) for t in _instructions(_kernel(tp, unroll, arch, False).ptx))


def test_the_driver_launcher_picks_the_all_to_all_slots_by_the_kernels_mode():
    """``launch.ALL_TO_ALL_PARAMS``: the gather's slots, then ``MAX_TP + 1`` int32 row
    offsets, checked against the all-to-all's PTX entry; the gather's slots are refused
    on it and its slots on the gather's (``DriverLaunch`` picks by
    ``compiled.all_to_all``)."""
    import ctypes

    from lamport_head.launch import ALL_TO_ALL_PARAMS, PARAMS, _AllToAllValues, kernel_entry
    from lamport_head.kernels.protocol import MAX_TP

    assert ALL_TO_ALL_PARAMS[:len(PARAMS)] == PARAMS
    tail = ALL_TO_ALL_PARAMS[len(PARAMS):]
    assert [n for n, _ in tail] == [f"offset{q}" for q in range(MAX_TP + 1)]
    assert all(c is ctypes.c_int32 for _, c in tail)
    starts = [getattr(_AllToAllValues, n).offset for n, _ in tail]
    assert starts == list(range(starts[0], starts[0] + 4 * len(tail), 4))  # one array
    for arch in ("sm_90a", "sm_80"):
        a2a, gather = compile_all_to_all(8, 10240, arch=arch), compile_gather(8, 10240, arch=arch)
        assert kernel_entry(a2a.ptx, ALL_TO_ALL_PARAMS) and kernel_entry(gather.ptx)
        with pytest.raises(ValueError, match="widths"):
            kernel_entry(a2a.ptx)
        with pytest.raises(ValueError, match="widths"):
            kernel_entry(gather.ptx, ALL_TO_ALL_PARAMS)
        assert a2a.all_to_all and not gather.all_to_all


@pytest.mark.parametrize("all_to_all", [False, True], ids=["gather", "all_to_all"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_gpu_starts_host_checks_pass_on_the_real_ptx_of_every_mode_and_dtype(
        monkeypatch, all_to_all, dtype):
    """What a GPU start runs on the compiled kernel before anything touches the device:
    ``build.Toolchain`` compiles it, the occupancy query names its entry
    (``Toolchain.resident``) and ``DriverLaunch`` checks its slots, each through
    ``launch.kernel_name``. Here the device's answers are stubbed at the driver (the
    occupancy count, the current context), so a mode whose PTX the host checks against
    another mode's slots fails on the CPU (0.6.0's all-to-all did, in ``resident``)."""
    from lamport_head import build, dtypes
    from lamport_head.config import GatherConfig
    from lamport_head import launch

    names = []
    monkeypatch.setattr(build, "resident_ctas",
                        lambda cubin, name, threads, index, smem: names.append(name) or 132)
    monkeypatch.setattr(launch, "current_context", lambda: 0)
    words = dtypes.words(163840 // 8, dtype)
    for config in (GatherConfig(24), GatherConfig(24, unroll=8)):  # plain, staged
        for pdl in (True, False):
            compiled = build.TOOLCHAIN.compiled(8, words, config, pdl, "sm_90a", all_to_all)
            assert compiled.all_to_all is all_to_all
            assert build.TOOLCHAIN.resident(compiled, type("D", (), {"index": 0})()) == 132
            assert names[-1] in compiled.ptx
            with pytest.raises(RuntimeError, match="no CUDA context"):  # past the slot check
                launch.DriverLaunch(compiled, serving=True)
            assert launch.slots(compiled) == (launch.ALL_TO_ALL_PARAMS if all_to_all
                                              else launch.PARAMS)


def _issued_together(ins, opcode):
    """Runs of ``opcode`` loads in ``ins`` issued back to back: no branch, label or read
    of an earlier load's registers between the first and the last. Returns
    ``(first index, last index, loads)`` per run."""
    runs, current, written = [], None, set()
    for i, t in enumerate(ins):
        body = re.sub(r"^@!?%?\w+\s+", "", t)
        if body.startswith(opcode + " "):
            target = body.split("[", 1)[0]
            if current is not None and any(r in written for r in re.findall(r"%r\d+", t.split("[", 1)[1])):
                runs.append(current)
                current, written = None, set()
            current = (current[0], i, current[2] + 1) if current else (i, i, 1)
            written |= set(re.findall(r"%r\d+", target))
            continue
        if current is None:
            continue
        read = set(re.findall(r"%r\d+", t.split(",", 1)[1] if "," in t else "")) & written
        if t.endswith(":") or re.search(r"\bbra\b", t) or read:
            runs.append(current)
            current, written = None, set()
    return runs + ([current] if current else [])


@pytest.mark.parametrize("tp", [2, 8])
def test_a_batchs_loads_are_issued_before_the_first_is_checked(tp):
    """Issue 51 item 2: a call's latency is round trips in a row. A batch's polls
    (``steps.fetch``, ``steps.repoll``) are predicated loads (``primitives.poll``) with
    no branch or check between them, so a spin costs one round trip, not one per
    fragment; the spin's mark read (late in a wait only) sits in the same run; and the
    push's first batch loads the shard before it reads the mark (``steps.push``), so
    the two round trips overlap. Fails on 21acae7's kernel (branches between polls,
    the mark read before the shard's loads)."""
    unroll = DEFAULT_UNROLL
    k = _kernel(tp, unroll, "sm_90a", False)
    ins = _mode(k, 1)
    polls = [r for r in _issued_together(ins, "ld.volatile.global.v4.u32") if r[2] == unroll]
    assert len(polls) >= 2, _issued_together(ins, "ld.volatile.global.v4.u32")  # fetch, repoll
    def next_access(i):  # the next load or store, guarded in its asm block or not
        return next(t for t in ins[i + 1:] if re.match(r"^(?:@!?%?\w+\s+)?(?:ld|st|atom|red)\.", t))

    assert re.match(r"@p ld\.volatile\.global\.u32", next_access(polls[-1][1]))  # the mark
    shard = [r for r in _issued_together(ins, "ld.global.v4.u32") if r[2] == unroll]
    assert shard, _issued_together(ins, "ld.global.v4.u32")
    assert next_access(shard[0][1]).startswith("ld.volatile.global.u32")  # the mark
