"""``compile_gather``: one compiled Gather per shape key, cached per process.
Invariant: no key names a mode (``serving`` is a run-time argument), so the kernel a
tuner times for a key is the kernel serving launches for it. The DSL's callable
launches on the caller's current torch stream, always explicit: with no stream it
would go to the legacy default stream, which serializes emulated ranks.
"""

import os
import tempfile
import threading
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .arch import has_pdl
from .gather import Gather
from . import protocol
from .protocol import DEFAULT_THREADS, DEFAULT_UNROLL, MAX_TP, THREADS, UNROLL_MAX, shared_bytes

_CACHE: dict = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class CompiledGather:
    """The DSL's callable ``launch``, declared for a BF16 shard (FP32 launches go through
    ``launch.DriverLaunch``), and what a host needs to launch it itself and audit it."""

    launch: object
    threads: int
    ptx: str
    cubin: bytes
    pdl: bool = False
    smem: int = 0  # dynamic shared memory per CTA, bytes
    all_to_all: bool = False  # ``launch`` takes the row offsets last
    tp: int = 0


def compile_gather(tp: int, shard_words: int, *, threads: int = DEFAULT_THREADS,
                   unroll: int = DEFAULT_UNROLL,
                   pdl: bool | None = None,
                   arch: str = "sm_90a", timers: bool = False,
                   staged: bool | None = None, all_to_all: bool = False) -> CompiledGather:
    """The compiled gather for this key, compiled at most once per process; ValueError
    on a key the kernel cannot serve. ``pdl`` and ``staged`` None: where ``arch`` has
    PDL, from ``protocol.STAGED_FROM``. ``timers`` (diagnostics): the status address
    must hold ``protocol.timer_words`` words."""
    if pdl is None:
        pdl = has_pdl(arch)
    elif pdl and not has_pdl(arch):
        raise ValueError(f"{arch} has no programmatic dependent launch (PDL needs sm_90 or "
                         "later): compile with pdl=False or None")
    if not isinstance(tp, int) or not 2 <= tp <= MAX_TP:
        raise ValueError(f"tp must be an int in [2, {MAX_TP}], got {tp!r}")
    if not isinstance(shard_words, int) or shard_words <= 0 or shard_words % 4:
        raise ValueError(f"a shard row of {shard_words!r} words is not a positive multiple "
                         "of 4 words (the shard width must be a multiple of 8 BF16)")
    if threads not in THREADS:
        raise ValueError(f"threads must be one of {THREADS}, got {threads!r}")
    if not isinstance(unroll, int) or not 1 <= unroll <= UNROLL_MAX:
        raise ValueError(f"unroll must be an int in [1, {UNROLL_MAX}], got {unroll!r}")
    if staged is None:
        staged = protocol.staged(unroll)
    key = (tp, shard_words, threads, unroll, bool(pdl), arch, bool(timers), bool(staged),
           bool(all_to_all))
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _compile(*key)
        return _CACHE[key]


def compile_all_to_all(tp: int, shard_words: int, **options) -> CompiledGather:
    return compile_gather(tp, shard_words, all_to_all=True, **options)


def _compile(tp, shard_words, threads, unroll, pdl, arch, timers, staged, all_to_all):
    rows = cute.sym_int32()
    shard = make_fake_compact_tensor(cutlass.BFloat16, (rows, 2 * shard_words), stride_order=(1, 0), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    with tempfile.TemporaryDirectory(prefix="lamport-head-") as dump:
        options = (f"--gpu-arch={arch} --enable-tvm-ffi --keep-ptx --keep-cubin "
                   f"--dump-dir={dump}")
        gather = Gather(tp, shard_words, threads, unroll, pdl, timers, staged, all_to_all)
        args = (shard, cutlass.Int64(0), cutlass.Int64(0), cutlass.Int32(0), cutlass.Int32(1),
                cutlass.Int64(0), cutlass.Int64(0), cutlass.Int32(0), stream)
        if all_to_all:
            offsets = tuple(cutlass.Int32(0) for _ in range(MAX_TP + 1))
            launch = cute.compile(gather.exchange, *args, offsets, options=options)
        else:
            launch = cute.compile(gather, *args, options=options)
        ptx, cubin = launch.__ptx__, launch.__cubin__
        if isinstance(ptx, str) and os.path.exists(ptx):
            ptx = open(ptx).read()
        if isinstance(cubin, str) and os.path.exists(cubin):
            cubin = open(cubin, "rb").read()
    return CompiledGather(launch, threads, ptx or "", cubin or b"", pdl,
                          shared_bytes(threads, unroll, staged), all_to_all, tp)
