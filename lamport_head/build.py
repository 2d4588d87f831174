"""The one build path: install, the emulation and the tuner's targets all build here, so
the tuner times the kernel serving launches, under the limit serving checks. No mode is
compiled in (``launch_flag``). Real ranks: docs/design.md, "Install order", step 5."""

from dataclasses import dataclass

import torch

from . import dtypes, kernels
from . import mailbox as boxes
from .collective import agree, attempt, step
from .kernels.arch import has_pdl
from .launch import DriverLaunch, bind_primary_context, kernel_name
from .mailbox import MAILBOXES, choose_backend
from .occupancy import device_arch, resident_ctas
from .plan import Limit, fit
from .status import MODES, SERVING, StatusRecord


class Toolchain:
    """The compiler and the driver, reached only through ``TOOLCHAIN`` (tests replace it)."""

    def arch(self, device) -> str:
        """The compile target of ``device``; ValueError for one the kernel cannot run on."""
        if device.type != "cuda":
            raise ValueError(f"HeadGather needs a CUDA device, got {device}")
        return device_arch(device)

    def pdl(self, arch) -> bool:
        return has_pdl(arch)

    def compiled(self, tp, words, config, pdl, arch, all_to_all=False):
        """The kernel for rows of ``words`` words and ``config``'s knobs, compiled once."""
        return kernels.compile_gather(tp, words, pdl=pdl, arch=arch, all_to_all=all_to_all,
                                      **config.kernel_knobs())

    def launcher(self, compiled, device, serving):
        """A ``launch.DriverLaunch`` of ``compiled`` in the device's primary context."""
        with torch.cuda.device(device):
            bind_primary_context(torch.device(device).index)
            return DriverLaunch(compiled, serving=serving)

    def resident(self, compiled, device) -> int:
        return resident_ctas(bytes(compiled.cubin), kernel_name(compiled), compiled.threads,
                             device.index, compiled.smem)


TOOLCHAIN = Toolchain()


def launch_flag(mode) -> int:
    """The kernel's ``serving`` argument for ``mode`` (the one check of a mode)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return int(mode == SERVING)


def cuda_device(device):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Kernels:
    """One rank's kernels (local): per config, the compiled kernel, its co-resident limit and
    its launcher; ``all_to_all``: every kernel is the all-to-all mode."""

    def __init__(self, device, tp, shard_width, pdl=None, dtype=dtypes.DEFAULT, all_to_all=False):
        self.device, self.tp, self.shard_width = device, tp, shard_width
        # only a mode that is on is passed: a gather-only stand-in keeps its signature
        self._mode = {"all_to_all": True} if all_to_all else {}
        self.words = dtypes.words(shard_width, dtype)
        self._toolchain = TOOLCHAIN
        self.arch = self._toolchain.arch(device)
        self.pdl = self._toolchain.pdl(self.arch) if pdl is None else bool(pdl)

    def compiled(self, config):
        return self._toolchain.compiled(self.tp, self.words, config, self.pdl, self.arch,
                                        **self._mode)

    def resident(self, config) -> int:
        return self._toolchain.resident(self.compiled(config), self.device)

    def limit(self, sharing) -> Limit:
        return Limit(self.resident, sharing, self.pdl)

    def launcher(self, config, flag):
        return self._toolchain.launcher(self.compiled(config), self.device, flag)


@dataclass
class Built:
    """What a rank's collective serves with: the fitted plan, ``clamped`` (``{rows: (asked,
    limit)}``, None when not clamping), a launcher per row count, the mailbox and status."""

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
    """Everything of a rank's build that can fail on this rank alone: the checks, the kernels,
    the plan (``plan_for(limit)``, fitted), the launchers and the status record; no mailbox."""
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
    """A rank's collective; ``plan_for(limit)`` gives its plan once the co-resident limit is
    known. With ``mailbox`` (emulation) it is local, else collective over ``group``."""
    device = cuda_device(device)
    if mailbox is not None:
        built = local(device, tp, rank, shard_width, plan_for, sharing=mailbox.sharing, **local_args)
        if mailbox.tp != tp or mailbox.words != tp * built.kernels.words:
            raise ValueError("the shared mailbox does not fit this gather")
        if mailbox.cap < built.cap:
            raise ValueError(f"the shared mailbox holds {mailbox.cap} rows, not {built.cap}")
        built.box = mailbox
        return built

    def bounded(what, fn, *args):
        return attempt(start_up, device, what, fn, *args)

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
        # a step given up on may still be inside the box in its helper thread: it stays
        if box is not None and not isinstance(error, TimeoutError):
            attempt(box.discard)
        raise
    built.box = box
    return built


def start_up(device, what, fn, *args):
    """``fn(*args)``, one start-up step, under the start-up deadline (read now, tests shorten
    it) via ``collective.step``, with ``device`` current in its threads."""
    scope = (lambda: torch.cuda.device(device)) if device.type == "cuda" else None
    return step(boxes.RENDEZVOUS_WAIT_S, f"lamport-head start-up: {what}", fn, *args,
                scope=scope)
