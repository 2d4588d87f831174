"""The one build path of a gather: ``Kernels`` (one rank's compiled kernels, their
occupancy limit and launchers), ``launch_flag`` (a mode as the kernel's argument) and
``build`` (a rank's gather, collective on real ranks).

Invariants a change must keep:

- ``install`` (serving), the emulation and both tuner targets build here, so the
  tuner times the cubin serving launches, under the limit serving checks.
- No mode is part of a compiled kernel: serving's give-up is the launch flag.
- On real ranks the build never strands a peer: each step (the backend's facts, the
  local part, the mailbox's allocation, mapping and arming) runs under the start-up
  deadline (``mailbox.RENDEZVOUS_WAIT_S``) with its collectives on the calling thread
  (``collective.step``), and the ranks agree after each.
- The compiler and the driver are reached only through ``TOOLCHAIN``, the seam a
  test replaces with a CPU stand-in.
"""

from dataclasses import dataclass

import torch

from . import dtypes, kernels
from . import mailbox as boxes  # its start-up deadline is read per build (a test shortens it)
from .collective import agree, attempt, step
from .kernels.arch import has_pdl
from .launch import DriverLaunch, bind_primary_context, kernel_name
from .mailbox import MAILBOXES, choose_backend
from .occupancy import device_arch, resident_ctas
from .plan import Limit, fit
from .status import MODES, SERVING, StatusRecord


class Toolchain:
    """The compiler and the driver, as a build reaches them: the device's compile
    target, the compiled gather of a ``GatherConfig``, how many CTAs of it the device
    holds, and its launcher."""

    def arch(self, device) -> str:
        """The compile target of ``device``; ValueError for a device the kernel cannot
        run on."""
        if device.type != "cuda":
            raise ValueError(f"HeadGather needs a CUDA device, got {device}")
        return device_arch(device)

    def pdl(self, arch) -> bool:
        """Whether gathers for ``arch`` launch with PDL (``kernels.arch.has_pdl``)."""
        return has_pdl(arch)

    def compiled(self, tp, words, config, pdl, arch, all_to_all=False):
        """The compiled gather (``.launch``, ``.cubin``, ``.threads``) of rows of ``words``
        32-bit words a rank (``dtypes.words``: the kernel moves words, whatever the
        dtype) for ``config``'s compile-time knobs, compiled once per process (the DSL
        loads on first use); ``all_to_all``: the kernel's all-to-all mode."""
        return kernels.compile_gather(tp, words, pdl=pdl, arch=arch, all_to_all=all_to_all,
                                      **config.kernel_knobs())

    def launcher(self, compiled, device, serving):
        """``compiled`` launched through the driver (``launch.DriverLaunch``, the
        cheaper host path) in the device's primary context, with the launch flag
        ``serving``. Called as ``launcher(shard, out, peers, rank, ctas, budget, status,
        stream)``."""
        with torch.cuda.device(device):
            bind_primary_context(torch.device(device).index)
            return DriverLaunch(compiled, serving=serving)

    def resident(self, compiled, device) -> int:
        """CTAs of ``compiled`` the whole device holds at once."""
        return resident_ctas(bytes(compiled.cubin), kernel_name(compiled), compiled.threads,
                             device.index, compiled.smem)


TOOLCHAIN = Toolchain()


def launch_flag(mode) -> int:
    """The kernel's ``serving`` argument for ``mode``, the one check of a mode: 1
    (serving's give-up traps) or 0 (recoverable: tools, tests, every tuner)."""
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
    """One rank's kernels for (device, tp, shard, dtype, collective): the compile target,
    PDL (None: where the architecture has it), and per configuration the compiled kernel
    of rows of ``words`` (``dtypes.words``: ``shard x itemsize / 4``), its occupancy limit
    and its launcher. ``all_to_all``: every kernel is the all-to-all mode (one collective
    a build). Local: no collective. ``TOOLCHAIN`` is read when it is built (the seam
    tests replace)."""

    def __init__(self, device, tp, shard_width, pdl=None, dtype=dtypes.DEFAULT, all_to_all=False):
        self.device, self.tp, self.shard_width = device, tp, shard_width
        # only a mode that is on reaches the toolchain: a stand-in of the gather alone
        # keeps its signature
        self._mode = {"all_to_all": True} if all_to_all else {}
        self.words = dtypes.words(shard_width, dtype)  # a row's 32-bit words: what the kernel moves
        self._toolchain = TOOLCHAIN
        self.arch = self._toolchain.arch(device)
        self.pdl = self._toolchain.pdl(self.arch) if pdl is None else bool(pdl)

    def compiled(self, config):
        """The one compiled kernel of ``config``'s knobs (its ``ctas`` is run-time)."""
        return self._toolchain.compiled(self.tp, self.words, config, self.pdl, self.arch,
                                        **self._mode)

    def resident(self, config) -> int:
        """CTAs of ``config``'s kernel the whole device holds (its ``ctas`` ignored)."""
        return self._toolchain.resident(self.compiled(config), self.device)

    def limit(self, sharing) -> Limit:
        """The co-resident limit of these kernels with ``sharing`` ranks on the device:
        what ``plan.fit`` checks a plan against."""
        return Limit(self.resident, sharing, self.pdl)

    def launcher(self, config, flag):
        return self._toolchain.launcher(self.compiled(config), self.device, flag)


@dataclass
class Built:
    """What a rank's gather serves with: the plan (``{rows: GatherConfig}``, fitted),
    ``clamped`` (``{rows: (asked, limit)}``, or None when not asked to clamp), a
    launcher per row count, the mailbox, the status record, the spin budget (ns) and
    ``dtype``, the torch dtype of the logits it serves."""

    device: torch.device
    tp: int
    rank: int
    shard_width: int
    mode: str
    sharing: int
    kernels: Kernels
    plan: dict
    clamped: dict | None
    launchers: dict
    status: StatusRecord
    budget_ns: int
    box: object = None
    dtype: object = None

    @property
    def cap(self):
        return max(self.plan)


def local(device, tp, rank, shard_width, plan_for, *, sharing, mode, pdl=None, budget_s,
          clamp=False, dtype=None, all_to_all=False) -> Built:
    """Everything of a rank's build that can fail on this rank alone: the checks, the
    kernels, the plan (``plan_for(limit)``, fitted to the limit; ``clamp``: rows over it
    cut to it), the launchers and the host-visible status record. No mailbox.
    ``dtype``: the logits' (a torch dtype or ``dtypes`` name; None: BF16); ``shard``
    must be whole 16-byte fragments of it. ``all_to_all``: the kernels are the
    all-to-all mode's (``lamport_head.all_to_all``)."""
    flag = launch_flag(mode)
    dtype = dtypes.torch_dtype(dtypes.DEFAULT if dtype is None else dtype)
    if tp < 2 or not 0 <= rank < tp:
        raise ValueError(f"need tp >= 2 and 0 <= rank < tp, got tp={tp} rank={rank}")
    if not budget_s > 0:
        raise ValueError(f"the spin budget must be a positive number of seconds, got {budget_s!r}")
    rank_kernels = Kernels(device, tp, shard_width, pdl, dtype, all_to_all)
    limit = rank_kernels.limit(sharing)
    clamped = {} if clamp else None
    plan = fit(plan_for(limit), limit, clamped)
    launchers = {m: rank_kernels.launcher(c, flag) for m, c in plan.items()}
    return Built(device, tp, rank, shard_width, mode, sharing, rank_kernels, plan, clamped, launchers,
                 StatusRecord(rank, tp), int(budget_s * 1e9), dtype=dtype)


def build(group, device, tp, rank, shard_width, plan_for, *, mailbox=None, backend=None,
          **local_args) -> Built:
    """A rank's gather. ``plan_for(limit)`` returns its plan (``{rows: GatherConfig}``)
    once the co-resident limit is known (``HeadGather`` passes a plan given, its
    ``default`` constructor the heuristic). ``local_args``: ``local``'s. With
    ``mailbox`` (a ``LocalMailbox`` shared by virtual ranks) it is local; else
    collective over ``group`` (module docstring)."""
    device = cuda_device(device)
    if mailbox is not None:  # emulated: one process, nothing to agree on
        built = local(device, tp, rank, shard_width, plan_for, sharing=mailbox.sharing, **local_args)
        if mailbox.tp != tp or mailbox.words != tp * built.kernels.words:
            raise ValueError("the shared mailbox does not fit this gather")
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
                           lambda: local(device, tp, rank, shard_width, plan_for, sharing=sharing,
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
    (``mailbox.RENDEZVOUS_WAIT_S``, read now): ``collective.step``
    (its collectives stay on this thread), with ``device`` current in its threads."""
    scope = (lambda: torch.cuda.device(device)) if device.type == "cuda" else None
    return step(boxes.RENDEZVOUS_WAIT_S, f"lamport-head start-up: {what}", fn, *args,
                scope=scope)
