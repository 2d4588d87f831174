"""The one build path of a gather: the kernel of a configuration, its occupancy limit,
the launch flag of a mode, and the collective build of a rank's gather.

``install`` (serving), ``tuning.support.emulate.EmulatedGather`` and both tuner targets
(``tuning.harness``; first-use tuning through ``DistributedTarget``) build through
here, so what the tuner times and the limit it searches under are what install
builds:

- ``Kernels(device, tp, shard, pdl, dtype)``: one rank's kernels for rows of ``shard``
  values of ``dtype`` (``dtypes.words``: ``shard x itemsize / 4`` words a row).
  ``compiled(config)`` is the one kernel of ``config``'s compile-time knobs; no mode
  is part of it (serving's give-up is a launch argument, ``kernels.protocol``), so the
  tuner times the cubin serving launches. ``limit(config, sharing)`` is the most CTAs
  per rank of that
  kernel that stay co-resident with ``sharing`` ranks on the device
  (``plan.co_resident_limit``): what ``plan`` accepts for a served row and where the
  tuner's search stops. ``launcher(config, mode)`` launches it with the mode's flag.
- ``launch_flag(mode)``: the kernel's ``serving`` argument of a mode: 1 for serving
  (a give-up traps), 0 for everything else, the tuner included (a failure while
  tuning stays recoverable on every rank).
- ``build(...)``: a rank's gather, all the parts ``HeadGather`` serves with
  (``Built``). On real ranks it is collective and never strands a peer: the backend's
  facts, then the local part (checks, compile, occupancy, plan, status record), the
  mailbox's allocation, mapping and arming, each under the start-up deadline
  (``mailbox.RENDEZVOUS_WAIT_S``) with its collectives on the calling thread
  (``collective.step``), and an agreement after each: a rank failing or blocking in
  one takes every rank to the same error within the deadline.

The compiler and the driver are reached only through ``KERNELS`` (``DeviceKernels``),
the seam a test replaces with a CPU stand-in.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .collective import agree, attempt, step
from .config import GatherConfig
from .kernels.arch import has_pdl
from . import dtypes
from .mailbox import MAILBOXES, choose_backend
from .plan import co_resident_limit, plan
from .status import MODES, SERVING, StatusRecord


class DeviceKernels:
    """Where a gather's kernels come from: the device's compile target, the compiled
    gather of a ``GatherConfig``, how many CTAs of it the device holds, and its
    launcher. The only place a build touches the compiler and the driver."""

    def arch(self, device) -> str:
        """The compile target of ``device``; ValueError for a device the kernel cannot
        run on."""
        if device.type != "cuda":
            raise ValueError(f"HeadGather needs a CUDA device, got {device}")
        from .occupancy import device_arch

        return device_arch(device)

    def pdl(self, arch) -> bool:
        """Whether gathers for ``arch`` launch with PDL (``kernels.arch.has_pdl``)."""
        return has_pdl(arch)

    def compiled(self, tp, words, config, pdl, arch):
        """The compiled gather (``.launch``, ``.cubin``, ``.threads``) of rows of ``words``
        32-bit words a rank (``dtypes.words``: the kernel moves words, whatever the
        dtype) for ``config``'s compile-time knobs, compiled once per process; one for
        every mode."""
        from .kernels import compile_gather

        return compile_gather(tp, words, pdl=pdl, arch=arch, **config.kernel_knobs())

    def launcher(self, compiled, device, serving):
        """How a gather launches ``compiled`` on ``device`` with the launch flag
        ``serving``: through the driver (``kernels.launch.DriverLaunch``: the TVM-FFI
        callable costs the host 1.4x a ``torch.add_`` per call, this launch 0.9x),
        loaded into the device's primary context (torch's). Called as
        ``launcher(shard, out, peers, rank, ctas, budget, status, stream)``."""
        from .kernels import DriverLaunch
        from .kernels.launch import bind_primary_context

        with torch.cuda.device(device):
            bind_primary_context(torch.device(device).index)
            return DriverLaunch(compiled, serving=serving)

    def resident(self, compiled, device) -> int:
        """CTAs of ``compiled`` the whole device holds at once."""
        from .kernels.launch import kernel_entry
        from .occupancy import resident_ctas

        return resident_ctas(bytes(compiled.cubin), kernel_entry(compiled.ptx), compiled.threads,
                             device.index, compiled.smem)


KERNELS = DeviceKernels()


def launch_flag(mode) -> int:
    """The kernel's ``serving`` argument for ``mode``: 1 (serving's give-up, trap) or 0
    (recoverable: tools, tests, every tuner)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return int(mode == SERVING)


def cuda_device(device):
    """``device`` as a torch device, a bare ``cuda`` given the current index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Kernels:
    """One rank's kernels for (device, tp, shard, dtype): the compile target, PDL (None:
    where the architecture has it), and per configuration the compiled kernel, its
    occupancy limit and its launcher. Local: no collective. ``KERNELS`` is read when
    it is built (the seam tests replace)."""

    def __init__(self, device, tp, shard, pdl=None, dtype=dtypes.DEFAULT):
        self.device, self.tp, self.shard = device, tp, shard
        self.words = dtypes.words(shard, dtype)  # a row's 32-bit words: what the kernel moves
        self._kernels = KERNELS
        self.arch = self._kernels.arch(device)
        self.pdl = self._kernels.pdl(self.arch) if pdl is None else bool(pdl)

    def compiled(self, config):
        """The one compiled kernel of ``config``'s knobs (its ``ctas`` is run-time)."""
        return self._kernels.compiled(self.tp, self.words, config, self.pdl, self.arch)

    def resident(self, config) -> int:
        """CTAs of ``config``'s kernel the whole device holds (its ``ctas`` ignored)."""
        return self._kernels.resident(self.compiled(config), self.device)

    def limit(self, config, sharing) -> int:
        """Most CTAs per rank of ``config``'s kernel (its ``ctas`` ignored) that stay
        co-resident when ``sharing`` ranks share the device: what ``plan`` accepts."""
        key = GatherConfig(1, **config.kernel_knobs())
        return co_resident_limit(self.resident(key), sharing, self.pdl)

    def launcher(self, config, mode):
        return self._kernels.launcher(self.compiled(config), self.device, launch_flag(mode))


@dataclass
class Built:
    """What a rank's gather serves with: the plan (``configs``: ``{rows: GatherConfig}``;
    ``clamped``: ``{rows: (asked, limit)}`` or None), a launcher per row count, the
    mailbox, the status record and the spin budget (ns); ``dtype``: the torch dtype of
    the logits it serves."""

    device: torch.device
    tp: int
    rank: int
    shard: int
    mode: str
    sharing: int
    kernels: Kernels
    configs: dict
    clamped: dict | None
    launchers: dict
    status: StatusRecord
    budget_ns: int
    box: object = None
    dtype: object = None

    @property
    def cap(self):
        return max(self.configs)


def local(device, tp, rank, shard, rows, asked, *, sharing, mode, pdl=None, budget_s,
          clamp=False, dtype=None, **knobs) -> Built:
    """Everything of a rank's build that can fail on this rank alone: the checks, the
    kernels, the plan (``plan.plan`` of ``rows`` with ``asked`` as its ``ctas``: the CTA
    count or GatherConfig asked for per row, None the default; compile, occupancy;
    ``clamp``: rows cut to the limit), the launchers and the host-visible status
    record. No mailbox (``Built.box`` None). ``dtype``: the logits' torch dtype (None:
    BF16), one of ``dtypes.NAMES``; ``shard`` must be whole fragments of it."""
    dtype = dtypes.torch_dtype(dtypes.DEFAULT if dtype is None else dtype)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if tp < 2 or not 0 <= rank < tp:
        raise ValueError(f"need tp >= 2 and 0 <= rank < tp, got tp={tp} rank={rank}")
    dtypes.words(shard, dtype)  # ValueError unless whole 16-byte fragments
    if not budget_s > 0:
        raise ValueError(f"the spin budget must be a positive number of seconds, got {budget_s!r}")
    kernels = Kernels(device, tp, shard, pdl, dtype)
    clamped = {} if clamp else None
    configs = plan(rows, asked, tp=tp, shard=shard, resident=kernels.resident, sharing=sharing,
                   pdl=kernels.pdl, clamped=clamped, dtype=dtype, **knobs)
    launchers = {m: kernels.launcher(c, mode) for m, c in configs.items()}
    return Built(device, tp, rank, shard, mode, sharing, kernels, configs, clamped, launchers,
                 StatusRecord(rank, tp), int(budget_s * 1e9), dtype=dtype)


def build(group, device, tp, rank, shard, rows, ctas=None, *, mailbox=None, backend=None,
          **local_args) -> Built:
    """A rank's gather (``HeadGather``'s arguments; ``local_args``: ``local``'s). ``rows``
    and ``ctas`` as ``HeadGather``'s: the row counts and the CTA count or GatherConfig
    asked for per row (``plan.plan``'s ``ctas``), or ``rows`` a plan ``{rows:
    GatherConfig}`` and ``ctas`` None. With ``mailbox`` (a ``LocalMailbox`` shared by
    virtual ranks) it is local; else collective over ``group`` (module docstring)."""
    asked = ctas  # the CTA count or GatherConfig asked for per row (None: the default)
    if isinstance(rows, Mapping):
        if ctas is not None:
            raise ValueError("rows maps row counts to GatherConfigs: pass no ctas")
        rows, asked = rows.keys(), dict(rows)  # a plan: each row's GatherConfig
    device = cuda_device(device)
    if mailbox is not None:  # emulated: one process, nothing to agree on
        words = dtypes.words(shard, local_args.get("dtype") or dtypes.DEFAULT)
        if mailbox.tp != tp or mailbox.words != tp * words:
            raise ValueError("the shared mailbox does not fit this gather")
        built = local(device, tp, rank, shard, rows, asked, sharing=mailbox.sharing, **local_args)
        if mailbox.cap < built.cap:
            raise ValueError(f"the shared mailbox holds {mailbox.cap} rows, not {built.cap}")
        built.box = mailbox
        return built

    def bounded(what, fn, *args):
        return attempt(start_up, device, what, fn, *args)

    # the backend and how many ranks share this GPU: gathered facts, the same on every
    # rank (a rank whose facts failed makes every rank raise)
    backend_of, error = bounded("describing the ranks' GPUs", choose_backend, group, device,
                                backend)
    agree(error, group, device, "to describe its GPU")
    kind, sharing = backend_of
    built, error = bounded("building the gather (checks, compile, occupancy)",
                           lambda: local(device, tp, rank, shard, rows, asked, sharing=sharing,
                                         **local_args))
    agree(error, group, device, "to build the gather (checks, compile, occupancy)")
    box, error = bounded(f"allocating its {kind} mailbox", MAILBOXES[kind], group, device, tp,
                         rank, built.cap, tp * built.kernels.words)
    try:
        agree(error, group, device, f"to allocate its {kind} mailbox")
        _, error = bounded(f"mapping the peers' {kind} mailboxes", box.connect)
        agree(error, group, device, f"to map the peers' {kind} mailboxes")

        def arm():
            box.arm()
            torch.cuda.synchronize(device)

        _, error = bounded("arming its mailbox", arm)
        agree(error, group, device, "to arm its mailbox")  # also: every rank armed
    except BaseException:
        # A build that failed frees this rank's box and mappings now (no gather ran:
        # nothing can still push), unless this rank's own step was given up on: its
        # helper thread may still be inside the box; it stays.
        if box is not None and not isinstance(error, TimeoutError):
            attempt(box.discard)
        raise
    built.box = box
    return built


def start_up(device, what, fn, *args):
    """``fn(*args)``, one start-up step of this rank, under the start-up deadline
    (``mailbox.RENDEZVOUS_WAIT_S``, read now): ``collective.step`` (its collectives stay
    on this thread; a step given up on never enters one later), with ``device`` current
    in its threads."""
    from .mailbox import RENDEZVOUS_WAIT_S

    scope = (lambda: torch.cuda.device(device)) if device.type == "cuda" else None
    return step(RENDEZVOUS_WAIT_S, f"lamport-head start-up: {what}", fn, *args, scope=scope)
