"""Every kernel variant cross-compiles on the CPU for every supported architecture
(``kernels.arch.ARCHS``: A100 to B300); its PTX moves mailbox data in 16-byte
system-scope stores and volatile polls, bounds its spin with the global timer, and
never uses multicast; PDL exactly where the architecture has it."""

import re

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
