"""How many CTAs of a compiled kernel a device can hold at once.

A Lamport gather's CTAs wait on pushes from other CTAs (the peers', and on one GPU
the other virtual ranks'), so every CTA of every rank sharing a device must be
resident together; a grid that does not fit would wait until its spin budget runs
out. The count comes from the driver's occupancy calculator on the kernel's cubin.
"""

import functools

import torch


def device_arch(device) -> str:
    """The compile target of ``device`` (``kernels.arch.target``: sm_90a on Hopper and
    later, plain sm_XY before)."""
    from .kernels.arch import target

    return target(*torch.cuda.get_device_capability(device))


@functools.lru_cache(maxsize=None)
def resident_ctas(cubin: bytes, name: str, threads: int, device_index: int, smem: int = 0) -> int:
    """CTAs of the cubin's kernel ``name`` (``threads`` per CTA, ``smem`` bytes of
    dynamic shared memory each) that fit on the device. The kernel is loaded as the
    launcher loads it (``kernels.launch.load_function``): once per context."""
    from cuda.bindings import driver as cu

    from .kernels.launch import checked, current_context, load_function

    torch.cuda.init()
    with torch.cuda.device(device_index):
        torch.cuda.current_stream()  # makes torch's primary context current
        function = load_function(cubin, name, current_context(), smem)
        per_sm = checked(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, smem),
                         "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return int(per_sm) * sms
