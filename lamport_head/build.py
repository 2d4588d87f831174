"""The one place a gather's kernels are built: the kernel variant a mode launches, the
occupancy limit of a configuration for (mode, sharing), and that variant's identity.

``HeadGather`` (install's serving gather, the tools' recoverable ones) and both tuner
targets (``tuning.harness``; first-use tuning through ``DistributedTarget``) build
through ``Kernels``, so what the tuner times, and the limit it searches under, are
what install builds:

- ``stop(mode)``: the compile-time give-up of ``mode`` (``kernels.protocol``):
  serving's traps, the recoverable one writes NaN and raises. ``TUNED`` is the mode
  the tuner builds its real-rank gathers in: ``SERVING``, so a tuned row names (and
  its timing measured) the kernel install launches for it.
- ``Kernels.limit(config, sharing)``: CTAs per rank of ``config``'s kernel (that
  mode's variant) that stay co-resident with ``sharing`` ranks on the device
  (``plan.co_resident_limit`` of ``resident``); ``plan`` checks every row against it.
- ``identity(mode)``: provenance's kernel identity of the variant ``mode`` builds.

The compiler and the driver are reached only through ``DeviceKernels`` (the seam a
CPU test replaces: ``head_gather.KERNELS``)."""

from .config import GatherConfig
from .kernels.arch import has_pdl
from .plan import co_resident_limit
from .status import MODES, SERVING

TUNED = SERVING  # the tuner times the kernel serving launches (issue 30 item 2)


def stop(mode) -> bool:
    """Whether ``mode``'s kernel is compiled with serving's give-up (``trap``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode == SERVING


def identity(mode, sources=None) -> str:
    """Provenance's kernel identity of the variant ``mode`` builds (reads the kernel
    files, imports no DSL)."""
    from .provenance import kernel_identity

    return kernel_identity(sources, stop=stop(mode))


class DeviceKernels:
    """Where a gather's kernels come from: the device's compile target, the compiled
    gather of a ``GatherConfig``, and how many CTAs of it the device holds. The only
    place construction touches the compiler and the driver; ``head_gather.KERNELS``
    is the seam a test replaces (with a CPU stand-in) to build gathers without a GPU."""

    def arch(self, device) -> str:
        """The compile target of ``device``; ValueError for a device the kernel cannot
        run on."""
        if device.type != "cuda":
            raise ValueError(f"HeadGather needs a CUDA device, got {device}")
        from .occupancy import device_arch

        return device_arch(device)

    def pdl(self, arch) -> bool:
        """Whether gathers for ``arch`` launch with PDL (the architecture decides:
        ``kernels.arch.has_pdl``)."""
        return has_pdl(arch)

    def compiled(self, tp, shard, config, pdl, arch, stop=False):
        """The compiled gather (``.launch``, ``.cubin``, ``.threads``) for ``config``'s
        compile-time knobs (compiled once per process); ``stop``: serving's give-up."""
        from .kernels import compile_gather

        return compile_gather(tp, shard // 2, pdl=pdl, arch=arch, stop=stop,
                              **config.kernel_knobs())

    def launcher(self, compiled, device):
        """How a gather launches ``compiled`` on ``device``: through the driver
        (``kernels.launch.DriverLaunch``: the TVM-FFI callable costs the host 1.4x a
        ``torch.add_`` per call, this launch 0.9x), loaded into the device's primary
        context (torch's). Called as ``launcher(shard, out, peers, rank, ctas, budget,
        status, stream)``."""
        import torch

        from .kernels import DriverLaunch
        from .kernels.launch import bind_primary_context

        with torch.cuda.device(device):
            bind_primary_context(torch.device(device).index)
            return DriverLaunch(compiled)

    def resident(self, compiled, device) -> int:
        """CTAs of ``compiled`` the whole device holds at once."""
        from .kernels.launch import kernel_entry
        from .occupancy import resident_ctas

        return resident_ctas(bytes(compiled.cubin), kernel_entry(compiled.ptx), compiled.threads,
                             device.index, compiled.smem)


class Kernels:
    """One rank's kernels of ``mode`` for (device, tp, shard): its compile target,
    PDL (None: where the architecture has it), the variant, and per configuration
    the compiled kernel, its occupancy limit and its launcher. Local: no collective."""

    def __init__(self, kernels, device, tp, shard, mode, pdl=None):
        self.stop = stop(mode)
        self.mode, self.device, self.tp, self.shard = mode, device, tp, shard
        self._kernels = kernels
        self.arch = kernels.arch(device)
        self.pdl = kernels.pdl(self.arch) if pdl is None else bool(pdl)

    def compiled(self, config):
        return self._kernels.compiled(self.tp, self.shard, config, self.pdl, self.arch,
                                      stop=self.stop)

    def resident(self, config) -> int:
        """CTAs of ``config``'s kernel the whole device holds (its ``ctas`` ignored)."""
        return self._kernels.resident(self.compiled(config), self.device)

    def limit(self, config, sharing) -> int:
        """Most CTAs per rank of ``config``'s kernel (its ``ctas`` ignored) that stay
        co-resident when ``sharing`` ranks share the device: what ``plan`` accepts."""
        key = GatherConfig(1, **config.kernel_knobs())
        return co_resident_limit(self.resident(key), sharing, self.pdl)

    def launcher(self, config):
        return self._kernels.launcher(self.compiled(config), self.device)

    def identity(self, sources=None) -> str:
        return identity(self.mode, sources)
