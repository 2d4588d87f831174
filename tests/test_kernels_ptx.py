"""Every kernel variant cross-compiles on the CPU for every supported architecture
(``kernels.arch.ARCHS``: A100 to B300); its PTX moves mailbox data in 16-byte
system-scope stores and volatile polls, bounds its spin with the global timer, and
never uses multicast; PDL exactly where the architecture has it."""

import re
import struct

import pytest

from lamport_head.kernels import ARCHS, compile_gather, has_pdl
from lamport_head.kernels.protocol import NAN_PAIR, staged


def _ops(ptx):
    return set(re.findall(r"\b(?:st|ld|multimem)\.[a-z0-9.:]+", ptx))


def _audit(k, tp, unroll, arch, staged=False):
    """What every compiled variant's PTX must show."""
    ops = _ops(k.ptx)
    assert f".target {arch}" in k.ptx
    assert "st.relaxed.sys.global.v4.u32" in ops  # peer pushes
    if staged:  # first reads of a batch through L2 into shared memory, 16 bytes each;
        # the fragments still armed are polled again with the volatile load
        assert "ld.volatile.global.v4.u32" in ops and "ld.global.v4.u32" not in ops
        assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16;", k.ptx)
        assert "cp.async.wait_all" in k.ptx and "ld.shared.v4.u32" in ops
        assert k.smem == 16 * unroll * k.threads
    else:
        assert "ld.volatile.global.v4.u32" in ops  # own-box polls
        assert k.smem == 0
    assert "st.global.v4.u32" in ops  # output and re-arm
    assert not any("multimem" in op for op in ops) and "multimem" not in k.ptx
    assert "%globaltimer" in k.ptx  # bounded spin
    assert "ld.volatile.global.u32" in ops  # the fail-stop mark is polled from memory
    assert "st.relaxed.sys.global.u32" in ops and "fence.sc.sys" in k.ptx  # record, fence, flag
    assert "atom.global.add.u32" in ops or "atom.global.add.u32" in k.ptx  # the epoch's CTA count
    assert str(NAN_PAIR) in k.ptx or hex(NAN_PAIR) in k.ptx.lower()  # missing -> NaN
    assert ("griddepcontrol.wait" in k.ptx) == has_pdl(arch)  # PDL where the arch has it
    # every push is one 16-byte store per peer per fragment in flight
    assert len(re.findall(r"st\.relaxed\.sys\.global\.v4\.u32", k.ptx)) == unroll * (tp - 1)
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
    default: A100 (sm_80, no PDL) to B300 (sm_103a); both give-up variants."""
    for stop in (False, True):
        k = compile_gather(tp, 163840 // tp // 2, arch=arch, stop=stop)
        _audit(k, tp, 4, arch, staged(4))
        assert bool(re.search(r"\btrap;", k.ptx)) == stop


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


@pytest.mark.parametrize("tp", [2, 8])
def test_serving_variant_traps_after_its_record_and_only_it(tp):
    """The stop (serving) variant ends a give-up in ``trap``, after the flag's store
    and a fence; the recoverable variant never traps (NaN, raise, reset)."""
    recoverable = compile_gather(tp, 163840 // tp // 2)
    serving = compile_gather(tp, 163840 // tp // 2, stop=True)
    assert serving is not recoverable  # ``stop`` is part of the compile key
    assert not re.search(r"\btrap;", recoverable.ptx)
    assert len(re.findall(r"\btrap;", serving.ptx)) == 1
    body = serving.ptx[:serving.ptx.index("trap;")]
    last_flag = body.rindex("st.relaxed.sys.global.u32")
    assert "fence.sc.sys" in body[last_flag:]  # record, fence, flag, fence, trap
    assert "multimem" not in serving.ptx and "%globaltimer" in serving.ptx


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
    """``timers=True`` (tuning/diagnostics/phases.py) stamps the global timer at each
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

    from lamport_head.kernels.launch import PARAMS, _Attribute, _Config, kernel_entry

    for arch in ARCHS:
        for stop in (False, True):
            assert kernel_entry(compile_gather(8, 10240, arch=arch, stop=stop).ptx)
    ptx = compile_gather(2, 1024).ptx
    assert kernel_entry(ptx) in ptx
    dropped = ptx.replace(".param .u32", ".param .u64", 1)  # rows widened
    with pytest.raises(ValueError, match="widths"):
        kernel_entry(dropped)
    with pytest.raises(ValueError, match="one .entry"):
        kernel_entry(ptx + ptx)
    assert [n for n, _ in PARAMS] == ["shard", "rows", "out", "peers", "rank", "budget", "status"]
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
        if not line or line.startswith((".", "{", "}")):
            continue
        out.append(line)
    return out


_MEMORY = re.compile(r"^(?:@!?%p\d+\s+)?(?:ld(?!\.param)|st|atom|red|fence|cp\.async|bar|trap)\b")


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


_FENCE_VARIANTS = [(tp, unroll, stop, arch) for arch in ("sm_90a", "sm_80") for tp in (2, 8)
                   for unroll in (4, 8) for stop in (False, True)]


@pytest.mark.parametrize("tp,unroll,stop,arch", _FENCE_VARIANTS)
def test_no_system_fence_before_the_pushes_the_kernel_boundary_orders_the_rearms(tp, unroll, stop,
                                                                                arch):
    """Issue 28 item 4, the re-arm: ordered before a peer's push into the same parity two
    calls later by the kernel boundary (PDL's wait, stream order), with no fence on the
    critical path: a ``fence.acq_rel.sys`` after the wait, measured on the H200, cost TP 8
    M = 1 7.31 -> 10.62 µs and TP 2 4.09 -> 5.70 (``steps`` docstring). Pinned: nothing
    of the call's protocol (mailbox loads, stores, atomics) comes before PDL's wait, and
    no system fence comes between the wait and the first push."""
    k = compile_gather(tp, 163840 // tp // 2, unroll=unroll, stop=stop, arch=arch)
    ins = _instructions(k.ptx)
    first_push = next(i for i, t in enumerate(ins) if t.startswith("st.relaxed.sys.global.v4"))
    start = ins.index("griddepcontrol.wait;") if has_pdl(arch) else 0
    before = [t for _, t in _memory_ops(ins[:start])]
    assert all(t.startswith("ld.global.b64") for t in before), before  # the peer table only
    assert not any(t.startswith(("fence.acq_rel.sys", "fence.sc.sys", "membar.sys"))
                   for t in ins[start:first_push])


@pytest.mark.parametrize("tp,unroll,stop,arch", _FENCE_VARIANTS)
def test_the_last_cta_count_is_released_and_acquired(tp, unroll, stop, arch):
    """Issue 28 item 4, the last-CTA pattern: ``bar.sync``, ``fence.acq_rel.gpu``, the
    done counter's ``atom.add`` (nothing of memory between them), and in the CTA that
    completes the count a second ``fence.acq_rel.gpu`` before its first read or write
    (the mark, the slow word, the counter's reset, the epoch's advance). Serving:
    between the barrier and the fence only the heartbeat (issue 29)."""
    k = compile_gather(tp, 163840 // tp // 2, unroll=unroll, stop=stop, arch=arch)
    ops = _memory_ops(_instructions(k.ptx))
    adds = [n for n, (_, t) in enumerate(ops) if t.startswith("atom.global.add.u32")]
    assert len(adds) == 1
    n = adds[0]
    assert ops[n - 1][1] == "fence.acq_rel.gpu;"
    barrier = max(m for m in range(n) if ops[m][1].startswith("bar.sync"))
    between = [t.split()[0] for _, t in ops[barrier + 1:n - 1]]
    # serving: only thread 0's heartbeat (the slow word, STATUS_SLOW) before its fence
    assert between == (["st.global.u32", "st.relaxed.sys.global.u32"] if stop else [])
    assert ops[n + 1][1] == "fence.acq_rel.gpu;"  # the last CTA's acquire, first of all
    assert [t for _, t in ops].count("fence.acq_rel.gpu;") == 2


@pytest.mark.parametrize("tp,unroll,stop,arch", _FENCE_VARIANTS)
def test_the_record_reads_the_missing_ranks_only_after_an_acquire(tp, unroll, stop, arch):
    """Issue 28 item 4, ``write_record``: the status record (missing ranks, epoch,
    ``fence.sc.sys``, flag) reads the tp missing-rank words of the control block only
    after a ``fence.acq_rel.sys`` that follows the mark's read: the record is in every
    variant once (recoverable: ``publish``; serving: ``record_and_stop``)."""
    k = compile_gather(tp, 163840 // tp // 2, unroll=unroll, stop=stop, arch=arch)
    ops = [t for _, t in _memory_ops(_instructions(k.ptx))]
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
# 8: 58, 64; TP 2 unroll 4: 54, 56; unroll 8: 40, 46.
REGISTER_CEILING = {(8, 4, False): 64, (8, 4, True): 64, (8, 8, False): 64, (8, 8, True): 64,
                    (2, 4, False): 56, (2, 4, True): 56, (2, 8, False): 40, (2, 8, True): 48}


@pytest.mark.parametrize("tp,unroll,stop", sorted(REGISTER_CEILING))
def test_registers_stay_within_the_ceiling(tp, unroll, stop):
    k = compile_gather(tp, 163840 // tp // 2, unroll=unroll, stop=stop, arch="sm_90a")
    allocated = -(-registers(k.cubin) // 8) * 8
    assert allocated <= REGISTER_CEILING[tp, unroll, stop], registers(k.cubin)


def _heartbeat_at(ins, i):
    """Whether ``ins[i:]`` opens with serving's heartbeat check: the global timer, then
    (before any other memory access) the control block's slow word and the host's
    ``STATUS_SLOW`` store."""
    if "%globaltimer" not in ins[i]:
        return False
    ops = [t for _, t in _memory_ops(ins[i + 1:])][:2]
    return (len(ops) == 2 and ops[0].startswith("st.global.u32")
            and ops[1].startswith("st.relaxed.sys.global.u32"))


@pytest.mark.parametrize("tp,unroll,stop,arch", _FENCE_VARIANTS)
def test_serving_raises_the_heartbeat_before_every_step_that_can_stall(tp, unroll, stop, arch):
    """Issue 29 item 2 (kernel side): the serving variant raises the slow heartbeat
    (``steps.heartbeat``: past half the budget, once per thread) before each push
    batch after the first (inside the push loop, before its system-scope stores),
    after each poll that left fragments dirty, and in thread 0 before the release
    fence of the CTA count; the last CTA's give-up raises it before the record's
    fences whatever the time, and the give-up's marks write the missing ranks into
    the host record before any store into a peer. The recoverable variant has none of
    it."""
    k = compile_gather(tp, 163840 // tp // 2, unroll=unroll, stop=stop, arch=arch)
    ins = _instructions(k.ptx)
    rearm = ins.index("griddepcontrol.wait;") if has_pdl(arch) else 0
    first_push = next(i for i, t in enumerate(ins) if t.startswith("st.relaxed.sys.global.v4"))
    beats = [i for i in range(rearm, first_push) if _heartbeat_at(ins, i)]
    assert len(beats) == (1 if stop else 0)
    if stop:  # inside the push loop: the loop's back edge jumps to a label before it
        label = next(ins[i][:-1] for i in range(beats[0], rearm, -1) if ins[i].endswith(":"))
        pushes = [i for i, t in enumerate(ins) if t.startswith("st.relaxed.sys.global.v4")]
        assert any(re.search(rf"\bbra(?:\.uni)?\s+{re.escape(label)};", t)
                   for t in ins[pushes[-1]:])
    polls = [i for i in range(first_push, len(ins)) if _heartbeat_at(ins, i)]
    assert len(polls) == (2 if stop else 0)  # the poll loop's and thread 0's before the count
    ops = _memory_ops(ins)
    texts = [t for _, t in ops]
    count = texts.index(next(t for t in texts if t.startswith("atom.global.add.u32")))
    barrier = max(n for n in range(count) if texts[n].startswith("bar.sync"))
    assert any(_heartbeat_at(ins, i) for i in range(ops[barrier][0], ops[count - 1][0])) == stop
    acquire = count + 1
    record = texts.index("fence.acq_rel.sys;")
    if stop:  # the give-up's heartbeat, after the last CTA's acquire, before the record
        assert acquire < record
        assert any(t.startswith("st.relaxed.sys.global.u32") for t in texts[acquire:record])
    # the give-up's marks: the host record's missing ranks (serving) before every store
    # into the control blocks, the fence, then the marks
    marks = texts.index(next(t for t in texts if t.startswith("atom.sys.global.max")))
    assert texts[marks - 1] == "fence.sc.sys;"
    last_delivery = max(n for n in range(marks) if texts[n].startswith("st.global.v4"))
    stores = [t for t in texts[last_delivery:marks] if t.startswith("st.relaxed.sys.global.u32")]
    assert len(stores) == tp * tp + (tp if stop else 0)
