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
def resident_ctas(cubin: bytes, threads: int, device_index: int) -> int:
    """CTAs of the cubin's single kernel (``threads`` per CTA) that fit on the device."""
    from cuda.bindings import driver as cu

    from .kernels.launch import checked

    torch.cuda.init()
    with torch.cuda.device(device_index):
        torch.cuda.current_stream()  # makes torch's primary context current
        library = checked(cu.cuLibraryLoadData(cubin, [], [], 0, [], [], 0), "cuLibraryLoadData")
        count = checked(cu.cuLibraryGetKernelCount(library), "cuLibraryGetKernelCount")
        kernels = checked(cu.cuLibraryEnumerateKernels(count, library), "cuLibraryEnumerateKernels")
        function = checked(cu.cuKernelGetFunction(kernels[0]), "cuKernelGetFunction")
        per_sm = checked(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, 0),
                         "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return int(per_sm) * sms
