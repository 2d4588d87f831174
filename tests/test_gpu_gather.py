"""HeadGather on one GPU with emulated TP ranks: bitwise against the reference."""

import random
import time

import pytest
import torch
from helpers import assert_same_words, no_stock, same_bits, words

from lamport_head import build
from lamport_head.tuning.support.emulate import EmulatedGather
from lamport_head.status import GatherTimeout
from lamport_head.kernels.protocol import CONTROL_EPOCH, EPOCH_SPAN, NAN_PAIR
from lamport_head.tuning.support.reference import planted, reference_gather
from lamport_head.benches.diagnostics.ranks import gpu_cycles

pytestmark = pytest.mark.gpu

ROWS = (1, 2, 3, 7, 8, 16, 33, 64)
POISON = 0x7FBF7FBF  # a NaN pair (a NaN FP32) the kernel never writes on its own (not NAN_PAIR)
DTYPES = [torch.bfloat16, torch.float32]  # the logits dtypes a gather serves (issue 42)


def _poison_allocator(rows, width, device, dtype=torch.bfloat16):
    """Leave freed blocks full of POISON where the next outputs will be allocated."""
    blocks = [torch.full((rows, width * dtype.itemsize // 4), POISON, dtype=torch.int32,
                         device=device) for _ in range(4)]
    del blocks


def _shards(tp, rows, shard, device, dtype=torch.bfloat16):
    data = planted(tp, rows, shard, device=device, dtype=dtype)
    return [data[r] for r in range(tp)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("vocab", [163840, 151936, 129280])
def test_emulated_bitwise_2000_calls(tp, vocab, dtype):
    """Planted data (reference.PLANTED: the sentinel word, -0.0, NaN payloads, ±Inf,
    denormals) of either dtype, outputs poisoned, M changing every call: bitwise the
    reference, the sentinel word arriving as 0."""
    device = torch.device("cuda", torch.cuda.current_device())
    shard = vocab // tp
    gather = EmulatedGather.default(device, tp, shard, ROWS, dtype=dtype)
    rng = random.Random(tp * 1000 + vocab)
    previous = None
    for call in range(2000):
        rows = rng.choice([m for m in ROWS if m != previous])  # M changes every call
        previous = rows
        shards = _shards(tp, rows, shard, device, dtype)
        _poison_allocator(rows, tp * shard, device, dtype)
        outs = gather(shards)
        want = reference_gather(shards)
        for r, out in enumerate(outs):
            assert out.shape == (rows, tp * shard) and out.dtype == dtype
            assert_same_words(out, want, f"call {call}, rank {r}, M={rows}")
    gather.check()
    assert gather.armed(), "mailbox words left un-armed after the run"


@pytest.mark.parametrize("threads, unroll", [(256, 12), (512, 8)])
def test_staged_kernels_over_47_kib_of_slots_launch_and_are_bitwise(threads, unroll):
    """Staged kernels of 48 KiB (256 x 12) and 64 KiB (512 x 8) of slots. The compiler
    adds 1 KiB of static shared memory (sm_90a), which counts against the driver's
    default 48 KiB per CTA too: the launcher opts in for every staged kernel. Fresh
    planted data, outputs poisoned first, M changing every call."""
    from lamport_head.config import GatherConfig
    from lamport_head.kernels.protocol import staged

    assert staged(unroll)
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 2, 163840 // 2
    gather = EmulatedGather(device, tp, shard, {m: GatherConfig(8, threads, unroll)
                                                for m in (1, 8, 33)})
    for call, rows in enumerate((8, 1, 33, 8, 33, 1) * 5):
        shards = _shards(tp, rows, shard, device)
        _poison_allocator(rows, tp * shard, device)
        want = reference_gather(shards)
        for r, out in enumerate(gather(shards)):
            assert_same_words(out, want, f"call {call}, rank {r}, M={rows}")
    gather.check()
    assert gather.armed()


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicitly_poisoned_outputs(dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 8, 163840 // 8
    gather = EmulatedGather.default(device, tp, shard, ROWS, dtype=dtype)
    for rows in (1, 64, 33, 2):
        shards = _shards(tp, rows, shard, device, dtype)
        outs = [torch.full((rows, tp * shard * dtype.itemsize // 4), POISON, dtype=torch.int32,
                           device=device).view(dtype) for _ in range(tp)]
        gather.launch(shards, outs, gather.plan[rows].ctas)
        want = reference_gather(shards).view(torch.int32)
        for out in outs:
            assert torch.equal(words(out), want)
    assert gather.armed()


def test_the_driver_launch_and_the_dsl_callable_agree_bitwise_from_any_thread():
    """HeadGather launches through the driver (``launch.DriverLaunch``); the
    DSL's own TVM-FFI callable of the same kernel, in alternate calls, must give the
    same words and keep the same parity sequence. The last rounds launch every rank
    from a fresh thread, where no CUDA context is current: a launch on an explicit
    stream takes its context from the stream (measured on the H200), so the driver
    refuses none of them (the retry path: the next test)."""
    import threading

    from lamport_head.launch import current_context

    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 4, 163840 // 4
    gather = EmulatedGather.default(device, tp, shard, ROWS)
    here = torch.cuda.current_stream(device)

    def dsl(shards, outs):
        for g, stream, x, out in zip(gather.ranks, gather.streams, shards, outs):
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                g.kernels.compiled(g.plan[x.shape[0]]).launch(
                    x, out.data_ptr(), g.peers_address, g.rank, g.plan[x.shape[0]].ctas, g.budget_ns,
                    g.status_address, build.launch_flag(g.mode))
        for stream in gather.streams:
            here.wait_stream(stream)

    def driver_from_a_fresh_thread(shards, outs):
        seen = []

        def run():
            seen.append(current_context())
            for g, stream, x, out in zip(gather.ranks, gather.streams, shards, outs):
                g._launch[x.shape[0]](x, out.data_ptr(), g.peers_address, g.rank, g.plan[x.shape[0]].ctas,
                                      g.budget_ns, g.status_address, stream.cuda_stream)

        for stream in gather.streams:
            stream.wait_stream(here)
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        for stream in gather.streams:
            here.wait_stream(stream)
        assert seen == [0], "the thread was meant to start with no current context"

    for call, rows in enumerate((1, 64, 8, 33, 2, 16, 1, 7)):
        shards = _shards(tp, rows, shard, device)
        outs = [torch.full((rows, tp * shard // 2), POISON, dtype=torch.int32,
                           device=device).view(torch.bfloat16) for _ in range(tp)]
        how = "driver, fresh thread" if call >= 6 else ("driver", "dsl")[call % 2]
        if how == "driver":
            gather.launch(shards, outs, gather.plan[rows].ctas)
        elif how == "dsl":
            dsl(shards, outs)
        else:
            driver_from_a_fresh_thread(shards, outs)
        want = reference_gather(shards).view(torch.int32)
        for r, out in enumerate(outs):
            assert_same_words(out, want, f"call {call} ({how}), rank {r}, M={rows}")
    gather.check()
    assert gather.armed()
    assert all(launch.refusals == 0 for g in gather.ranks for launch in g._launch.values())


def test_a_null_stream_launch_under_another_context_is_retried_in_the_kernels():
    """A launch on the null stream (handle 0) from a thread where another CUDA context
    is current is refused (the stream cannot name the context); the launcher retries
    that refusal once with the device's primary context pushed, and the gather is
    bitwise right on every rank, with one refusal counted."""
    import threading

    from cuda.bindings import driver as cu

    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard, rows = 2, 163840 // 2, 8
    gather = EmulatedGather.default(device, tp, shard, (1, rows))
    shards = _shards(tp, rows, shard, device)
    outs = [torch.full((rows, tp * shard // 2), POISON, dtype=torch.int32,
                       device=device).view(torch.bfloat16) for _ in range(tp)]
    torch.cuda.synchronize(device)
    first = gather.ranks[0]._launch[rows]
    errors, contexts = [], []

    def other_context():
        status, dev = cu.cuDeviceGet(device.index)
        status, context = cu.cuCtxCreate(None, 0, dev)
        assert status == cu.CUresult.CUDA_SUCCESS, status
        contexts.append(context)
        try:
            g = gather.ranks[0]
            first(shards[0], outs[0].data_ptr(), g.peers_address, g.rank, g.plan[rows].ctas, g.budget_ns,
                  g.status_address, 0)
        except Exception as exc:  # reported below, after the peers launched
            errors.append(exc)
        finally:
            cu.cuCtxPopCurrent()

    worker = threading.Thread(target=other_context)
    worker.start()
    worker.join()
    for g, stream in zip(gather.ranks[1:], gather.streams[1:]):  # non-blocking streams
        g._launch[rows](shards[g.rank], outs[g.rank].data_ptr(), g.peers_address, g.rank,
                        g.plan[rows].ctas, g.budget_ns, g.status_address, stream.cuda_stream)
    torch.cuda.synchronize(device)
    # Destroyed only now: destroying a context waits for the device (measured on the
    # H200: before the peers launched, rank 0's wait for them ran out meanwhile).
    for context in contexts:
        cu.cuCtxDestroy(context)
    assert errors == [] and first.refusals == 1
    want = reference_gather(shards).view(torch.int32)
    for r, out in enumerate(outs):
        assert_same_words(out, want, f"rank {r}")
    gather.check()
    assert gather.armed()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallbacks_take_stock_bitwise(dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 4, 1024
    gather = EmulatedGather.default(device, tp, shard, (1, 2), dtype=dtype)
    g = gather.ranks[0]
    stock = lambda x: torch.cat([x] * tp, dim=-1)  # noqa: E731
    x = planted(5, shard, device=device, dtype=dtype)  # 5 rows: not served
    assert same_bits(g(x, stock), stock(x))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16  # the other dtype
    # (a non-contiguous or unaligned tensor is copied, never stock: test_head_gather_cpu)
    for bad in (x[:1].to(other), x[:1].half(), x[:1, :-8], x[0], x[:1].unsqueeze(0)):
        got = g(bad, stock)
        assert same_bits(got, stock(bad))
    # no fallback launched a kernel: the rank's device epoch (its parity) never moved
    assert g.box.control(g.rank)[CONTROL_EPOCH].item() == 0


def _check_steps(steps, outs, tp):
    for i, (shards, row) in enumerate(zip(steps, outs)):
        want = reference_gather(shards).view(torch.int32)
        for r, out in enumerate(row):
            assert_same_words(out, want, f"step {i}, rank {r}, M={shards[0].shape[0]}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_free_running_ranks_bitwise(tp, dtype):
    """No join between steps: a virtual rank may be whole calls ahead of another. The
    default plan (no table) must keep every rank's CTAs co-resident with PDL's early
    launches (TP 8, M = 8 back to back used to time out). Distinct data every step,
    checked after the run."""
    device = torch.device("cuda", torch.cuda.current_device())
    shard = 163840 // tp
    gather = EmulatedGather.default(device, tp, shard, ROWS, dtype=dtype)
    rng = random.Random(tp)
    for batch in range(6):
        ms = [8] * 16 if batch == 0 else [rng.choice(ROWS) for _ in range(40)]
        steps = [_shards(tp, m, shard, device, dtype) for m in ms]
        _poison_allocator(64, tp * shard, device, dtype)
        outs = gather.free_run(steps)
        torch.cuda.synchronize(device)
        _check_steps(steps, outs, tp)
    gather.check()
    assert gather.armed()


def _every_rank_raises_at_the_same_call(gather, shards, missing, skip=()):
    """After call s gave up (synced): check() raises on every rank at once (the
    mark); call s + 1 runs on every rank and returns NaN for every peer fragment (it
    began marked); after a sync, call s + 2 raises on every rank, and keeps raising."""
    name = rf"rank\(s\) {missing} never published"
    for g in gather.ranks:
        with pytest.raises(GatherTimeout, match=name):
            g.check()
    outs = gather(shards, skip=skip)
    torch.cuda.synchronize(gather.device)
    shard = gather.shard_width
    want = reference_gather(shards).view(torch.int32)
    for r, out in enumerate(outs):
        if out is None:
            continue
        words = out.view(torch.int32).clone()
        own = slice(r * shard // 2, (r + 1) * shard // 2)
        assert torch.equal(words[:, own], want[:, own])
        words[:, own] = NAN_PAIR
        assert (words == NAN_PAIR).all(), f"rank {r}: call s + 1 delivered a peer fragment"
    for r, g in enumerate(gather.ranks):
        if r in skip:
            continue
        for _ in range(2):
            with pytest.raises(GatherTimeout, match=name):
                g(shards[r], no_stock("stock taken alone"))


def test_slow_rank_inside_the_budget_is_right():
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 4, 163840 // 4
    gather = EmulatedGather.default(device, tp, shard, ROWS, budget_s=2.0)
    steps = [_shards(tp, m, shard, device) for m in (8, 1, 64, 3)]
    outs = gather.free_run(steps, delay={2: gpu_cycles(0.3, device)})
    torch.cuda.synchronize(device)
    _check_steps(steps, outs, tp)
    gather.check()
    assert gather.armed()


def test_slow_rank_past_the_budget_every_rank_raises_none_serves():
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard, slow = 4, 163840 // 4, 1
    gather = EmulatedGather.default(device, tp, shard, ROWS, budget_s=0.3)
    steps = [_shards(tp, 8, shard, device)]
    start = time.monotonic()
    (outs,) = gather.free_run(steps, delay={slow: gpu_cycles(1.0, device)})
    torch.cuda.synchronize(device)
    print(f"\nslow rank: the step ended after {time.monotonic() - start:.2f} s (budget 0.3 s)")
    want = reference_gather(steps[0]).view(torch.int32)
    cols = slice(slow * shard // 2, (slow + 1) * shard // 2)
    for r, out in enumerate(outs):
        words = out.view(torch.int32)
        # the slow rank's fragments never came: NaN, never stale bytes. The slow rank
        # found the mark set when it began: it delivers no peer fragment, only its own.
        own = slice(r * shard // 2, (r + 1) * shard // 2)
        nan = torch.zeros_like(words, dtype=torch.bool)
        if r != slow:
            nan[:, cols] = True
        else:
            nan[:, :] = True
            nan[:, own] = False
        assert (words[nan] == NAN_PAIR).all(), f"rank {r}: missing columns not NaN"
        assert torch.equal(words[~nan], want[~nan])
    _every_rank_raises_at_the_same_call(gather, steps[0], slow)
    gather.reset()
    assert gather.armed()
    steps = [_shards(tp, m, shard, device) for m in (8, 2, 64)]
    outs = gather.free_run(steps)
    torch.cuda.synchronize(device)
    _check_steps(steps, outs, tp)


def test_dead_rank_times_out_and_gpu_recovers():
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 4, 4096
    gather = EmulatedGather.default(device, tp, shard, (1, 4), budget_s=0.5)
    shards = _shards(tp, 4, shard, device)
    start = time.monotonic()
    gather(shards, skip=(2,))
    torch.cuda.synchronize(device)
    waited = time.monotonic() - start
    print(f"\ntimeout: a dead virtual rank was reported after {waited:.3f} s (budget 0.5 s)")
    assert waited < 0.5 + 1.0, f"timed-out gather took {waited:.2f} s"
    _every_rank_raises_at_the_same_call(gather, shards, 2, skip=(2,))
    gather.reset()
    shards = _shards(tp, 4, shard, device)
    outs = gather(shards)
    want = reference_gather(shards)
    assert all(same_bits(o, want) for o in outs)
    assert gather.armed()


def test_every_missing_rank_is_named():
    """Two dead virtual ranks: every survivor's record names both, whichever of its
    threads gave up first (after a give-up, the remaining batches are still read)."""
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 8, 163840 // 8
    gather = EmulatedGather.default(device, tp, shard, (64,), budget_s=0.3)
    shards = _shards(tp, 64, shard, device)
    gather(shards, skip=(2, 5))
    torch.cuda.synchronize(device)
    for r in (0, 1, 3, 4, 6, 7):
        with pytest.raises(GatherTimeout, match=r"rank\(s\) 2, 5 never published"):
            gather.ranks[r].check()


def test_the_epoch_wraps_keeping_the_parity_and_the_fail_stop():
    """The device epoch counts launches modulo EPOCH_SPAN (a mark, MARK_TOP - epoch,
    must never read 0 or overflow, as it would at 2**31). Started three calls before
    the wrap, free-running calls across it stay bitwise (the parity alternates across
    it); a rank dead in the last call before the wrap still makes every rank raise at
    the same call (the failure is seen behind the epochs after the wrap)."""
    device = torch.device("cuda", torch.cuda.current_device())
    tp, shard = 4, 163840 // 4
    gather = EmulatedGather.default(device, tp, shard, ROWS, budget_s=0.3)

    def epochs(value=None):
        torch.cuda.synchronize(device)
        if value is not None:
            for r in range(tp):
                gather.box.control(r)[CONTROL_EPOCH] = value
            torch.cuda.synchronize(device)
        return [int(gather.box.control(r)[CONTROL_EPOCH]) for r in range(tp)]

    epochs(EPOCH_SPAN - 3)
    steps = [_shards(tp, m, shard, device) for m in (8, 1, 64, 3, 2, 16)]
    outs = gather.free_run(steps)
    assert epochs() == [3] * tp  # wrapped: (EPOCH_SPAN - 3 + 6) mod EPOCH_SPAN
    _check_steps(steps, outs, tp)
    gather.check()
    assert gather.armed()

    epochs(EPOCH_SPAN - 1)
    shards = _shards(tp, 8, shard, device)
    gather(shards, skip=(2,))
    torch.cuda.synchronize(device)
    _every_rank_raises_at_the_same_call(gather, shards, 2, skip=(2,))
    gather.reset()
    assert epochs() == [0] * tp and gather.armed()
    shards = _shards(tp, 8, shard, device)
    outs = gather(shards)
    want = reference_gather(shards).view(torch.int32)
    assert all(torch.equal(words(o), want) for o in outs)
