"""Co-residency beside another collective (issue 28 item 5), on one GPU.

A persistent kernel on another stream holds whole SMs (one CTA per SM: it asks the
device's largest dynamic shared memory per CTA, so no CTA of the gather fits beside
it) and spins on a flag in pinned host memory until the host releases it, as a
collective of another group spinning on its peers would. Gathers of emulated ranks
(recoverable mode) run meanwhile:

- holding exactly the plan's headroom (``plan.headroom_sms``), the largest plan the
  limit accepts (without PDL: every rank's CTAs at once) runs bitwise, each call well
  within its budget: the headroom is whole SMs;
- holding every SM but two, the gather completes bitwise or gives up cleanly (NaN
  only where fragments are missing, ``GatherTimeout`` on every rank, no hang), each
  call bounded by about one budget; after the release, a ``reset`` and a bitwise call.

The holder is a CuTe DSL kernel built from the gather's own primitives (volatile
load of the flag, system-scope stores of its progress), compiled by the DSL and
launched through the driver (no nvcc); its spin is bounded by the global timer
(``HOLD_BOUND_S``), so it ends by itself however the test ends. Nothing here
synchronizes the whole device while the holder runs (that would wait for it): every
wait is an event polled against a deadline. The last test compiles the holder on
the CPU (no GPU needed).
"""

import ctypes
import functools
import os
import re
import tempfile
import time

import pytest
import torch

HOLD_BOUND_S = 120.0  # the holder's own bound on its spin
START_S = 20.0  # how long every holder CTA may take to start
THREADS = 32  # the holder's CTA: one warp; what holds the SM is its shared memory


@functools.lru_cache(maxsize=None)
def holder_kernel(arch):
    """``(cubin, entry name, ptx)`` of the holder for ``arch``, compiled once."""
    import cutlass.cute as cute
    from cutlass import Int32, Int64, Uint32

    from lamport_head.kernels.primitives import load_word_volatile, store_word_sys

    class Holder:
        """``started[cta]`` = 1 at start, then spin until ``flag`` (pinned host
        memory) is not 0 or ``bound`` ns passed, then ``started[cta]`` = 2."""

        @cute.jit
        def __call__(self, flag: Int64, started: Int64, bound: Int64, ctas: Int32):
            self.kernel(flag, started, bound).launch(grid=(ctas, 1, 1), block=(THREADS, 1, 1))

        @cute.kernel
        def kernel(self, flag: Int64, started: Int64, bound: Int64):
            tid, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            if tid == 0:
                store_word_sys(started + Int64(cta) * 4, 1)
                begin = cute.arch.globaltimer()
                spinning = Int32(1)
                while spinning != 0:
                    if load_word_volatile(flag) != Uint32(0):
                        spinning = Int32(0)
                    if cute.arch.globaltimer() - begin > bound:
                        spinning = Int32(0)
                store_word_sys(started + Int64(cta) * 4, 2)

    with tempfile.TemporaryDirectory(prefix="lamport-head-holder-") as dump:
        compiled = cute.compile(Holder(), Int64(0), Int64(0), Int64(0), Int32(1),
                                options=f"--gpu-arch={arch} --keep-ptx --keep-cubin "
                                        f"--dump-dir={dump}")
        ptx, cubin = compiled.__ptx__, compiled.__cubin__
        if isinstance(ptx, str) and os.path.exists(ptx):
            ptx = open(ptx).read()
        if isinstance(cubin, str) and os.path.exists(cubin):
            cubin = open(cubin, "rb").read()
    (name,) = re.findall(r"\.entry\s+(\w+)\s*\(", ptx)
    return bytes(cubin), name, ptx


def _attribute(device_index, name):
    from cuda.bindings import driver as cu

    from lamport_head.launch import checked

    device = checked(cu.cuDeviceGet(device_index), "cuDeviceGet")
    return int(checked(cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, name), device),
                       "cuDeviceGetAttribute"))


class HeldSMs:
    """``with HeldSMs(device, count) as held``: ``count`` SMs held by the holder on a
    stream of their own until ``held.release()`` (or the block's end)."""

    def __init__(self, device, count):
        from cuda.bindings import driver as cu

        from lamport_head.launch import checked, current_context, load_function
        from lamport_head.occupancy import device_arch

        self.device, self.count = device, count
        index = device.index
        self.smem = _attribute(index, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        reserved = _attribute(index, "CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK")
        per_sm = _attribute(index, "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
        # no CTA (every CTA takes the reserved bytes at least) fits beside a holder CTA
        assert self.smem + 2 * reserved > per_sm, (self.smem, reserved, per_sm)
        cubin, name, _ = holder_kernel(device_arch(device))
        with torch.cuda.device(device):
            torch.cuda.current_stream()  # torch's primary context, current
            self.function = load_function(cubin, name, current_context(), self.smem)
            one = checked(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.function, THREADS, self.smem), "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        assert one == 1, f"the holder fits {one} CTAs per SM, not one"
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.started = torch.zeros(count, dtype=torch.int32, pin_memory=True)
        self.stream = torch.cuda.Stream(device)
        self.done = torch.cuda.Event()
        self.released = False

    def __enter__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        launch = lib.cuLaunchKernel
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        launch.restype = ctypes.c_int
        self._values = (ctypes.c_uint64 * 3)(self.flag.data_ptr(), self.started.data_ptr(),
                                             int(HOLD_BOUND_S * 1e9))
        base = ctypes.addressof(self._values)
        self._params = (ctypes.c_void_p * 3)(base, base + 8, base + 16)
        code = launch(self.function, self.count, 1, 1, THREADS, 1, 1, self.smem,
                      self.stream.cuda_stream, self._params, None)
        assert code == 0, f"cuLaunchKernel of the holder failed: {code}"
        self.done.record(self.stream)
        end = time.monotonic() + START_S
        while int((self.started == 1).sum()) < self.count:
            if time.monotonic() > end:
                self.release()
                pytest.fail(f"only {int((self.started == 1).sum())} of {self.count} holder "
                            f"CTAs started in {START_S} s")
            time.sleep(0.001)
        return self

    def release(self):
        """Raise the flag; wait (bounded) for every holder CTA to end."""
        if self.released:
            return
        self.released = True
        self.flag[0] = 1
        wait(self.done, HOLD_BOUND_S, "the holder after its release")

    def __exit__(self, *exc):
        self.release()


def wait(event, seconds, what, held=None):
    """Poll ``event`` until it completed; fail naming ``what`` after ``seconds``
    (releasing ``held`` first, so the GPU is free for what follows)."""
    end = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > end:
            if held is not None:
                held.release()
            pytest.fail(f"{what}: not complete after {seconds} s (a hang)")
        time.sleep(0.0005)


def _shards(tp, rows, shard, device):
    from lamport_head.tuning.support.reference import planted

    data = planted(tp, rows, shard, device=device)
    return [data[r] for r in range(tp)]


def _calls(tp, shard, device, pattern):
    """Shards and the reference of each call of ``pattern`` (row counts), made before
    anything is held."""
    from lamport_head.tuning.support.reference import reference_gather

    calls = []
    for rows in pattern:
        shards = _shards(tp, rows, shard, device)
        calls.append((shards, reference_gather(shards).view(torch.int32)))
    return calls


def _run(gather, shards):
    """One emulated step; its completion event (recorded on the current stream, which
    the ranks' streams joined)."""
    outs = gather(shards)
    done = torch.cuda.Event()
    done.record()
    return outs, done


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 8])
def test_the_largest_plan_runs_bitwise_beside_a_kernel_holding_the_headroom(tp):
    """The headroom is whole SMs: with ``headroom_sms`` SMs held, the plan's limit
    (no PDL: every rank's CTAs resident at once) fits on the other SMs, and every
    call completes bitwise well within its budget (no give-up)."""
    from lamport_head.config import GatherConfig
    from lamport_head.tuning.support.emulate import EmulatedGather
    from lamport_head.kernels import compile_gather
    from lamport_head.launch import kernel_entry
    from lamport_head.occupancy import device_arch, resident_ctas
    from lamport_head.plan import co_resident_limit, headroom_sms

    device = torch.device("cuda", torch.cuda.current_device())
    work = torch.cuda.Stream(device)
    shard = 163840 // tp
    kernel = compile_gather(tp, shard // 2, pdl=False, arch=device_arch(device))
    resident = resident_ctas(bytes(kernel.cubin), kernel_entry(kernel.ptx), kernel.threads,
                             device.index, kernel.smem)
    limit = co_resident_limit(resident, tp, False)
    held = headroom_sms(resident.sms)
    assert tp * limit <= (resident.sms - held) * resident.per_sm
    budget = 5.0
    with torch.cuda.stream(work):
        gather = EmulatedGather(device, tp, shard, {m: GatherConfig(limit) for m in (1, 64)},
                                pdl=False, budget_s=budget)
        calls = _calls(tp, shard, device, (64, 1, 64, 64, 1, 64))
        for shards, want in calls[:2]:  # warm: compiled, loaded, the allocator's blocks
            outs, done = _run(gather, shards)
            wait(done, 60, "a warm-up call")
            assert all(torch.equal(o.view(torch.int32), want) for o in outs)
        with HeldSMs(device, held) as holder:
            for call, (shards, want) in enumerate(calls):
                t0 = time.monotonic()
                outs, done = _run(gather, shards)
                wait(done, 2 * budget + 10, f"call {call} beside {held} held SMs", holder)
                took = time.monotonic() - t0
                assert holder.started.eq(1).all(), "a holder CTA ended while it was needed"
                assert took < budget / 2, (
                    f"call {call} took {took:.2f} s beside {held} held SMs: its CTAs "
                    f"({tp} ranks x {limit}) did not all fit on the other "
                    f"{resident.sms - held} SMs ({resident!r})")
                for r, out in enumerate(outs):
                    assert torch.equal(out.view(torch.int32), want), f"call {call}, rank {r}"
        gather.check()
        assert gather.armed()


@pytest.mark.gpu
def test_a_gather_beside_a_kernel_holding_nearly_every_sm_completes_or_gives_up_cleanly():
    """Every SM but two held: TP 8's default plan cannot be resident. Each call ends
    within about one budget (the give-up) with every output word either the
    reference's or NaN (a missing fragment), or the call raises ``GatherTimeout``
    (the flag of an earlier give-up); a give-up and the mark go together. After the
    release: ``check``/``reset``, then a bitwise call."""
    from lamport_head.tuning.support.emulate import EmulatedGather
    from lamport_head.status import GatherTimeout
    from lamport_head.kernels.protocol import NAN_PAIR

    device = torch.device("cuda", torch.cuda.current_device())
    work = torch.cuda.Stream(device)
    tp, shard, budget = 8, 163840 // 8, 1.0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    nan = torch.tensor(NAN_PAIR, dtype=torch.int32)  # below 2**31: the same int32
    with torch.cuda.stream(work):
        gather = EmulatedGather.default(device, tp, shard, (1, 64), budget_s=budget)
        calls = _calls(tp, shard, device, (64, 1, 64, 1, 64, 1))
        for shards, want in calls[:2]:
            outs, done = _run(gather, shards)
            wait(done, 60, "a warm-up call")
            assert all(torch.equal(o.view(torch.int32), want) for o in outs)
        seen = []  # per call: "bitwise", "nan" or "raised"
        with HeldSMs(device, sms - 2) as holder:
            for call, (shards, want) in enumerate(calls):
                t0 = time.monotonic()
                try:
                    outs, done = _run(gather, shards)
                except GatherTimeout as exc:
                    assert "gave up waiting" in str(exc)
                    seen.append("raised")
                    break
                wait(done, 2 * budget + 10, f"call {call} beside {sms - 2} held SMs", holder)
                took = time.monotonic() - t0
                assert took < 2 * budget + 5, f"call {call} took {took:.2f} s"
                clean = True
                for r, out in enumerate(outs):
                    got = out.view(torch.int32)
                    wrong = got != want
                    assert torch.equal(got[wrong].cpu(), nan.expand(int(wrong.sum()))), (
                        f"call {call}, rank {r}: a word neither the reference's nor NaN")
                    clean = clean and not bool(wrong.any())
                seen.append("bitwise" if clean else "nan")
        torch.cuda.synchronize(device)  # the holder is gone: a device sync is safe again
        gave_up = any(s != "bitwise" for s in seen)
        if gave_up:
            with pytest.raises(GatherTimeout):
                gather.check()
            gather.reset()
        else:
            gather.check()
        shards, want = calls[0]
        outs, done = _run(gather, shards)
        wait(done, 60, "the call after the release")
        assert all(torch.equal(o.view(torch.int32), want) for o in outs)
        gather.check()
        assert gather.armed()
        print(f"beside {sms - 2} held SMs of {sms}: {seen}")


def test_the_holder_compiles_on_the_cpu_and_bounds_its_spin():
    """The holder's PTX (sm_90a): the flag read with a volatile load, the global timer
    bounding the spin, its progress stored at system scope (host memory)."""
    _, name, ptx = holder_kernel("sm_90a")
    assert name in ptx and ".target sm_90a" in ptx
    assert "ld.volatile.global.u32" in ptx and "%globaltimer" in ptx
    assert ptx.count("st.relaxed.sys.global.u32") == 2
