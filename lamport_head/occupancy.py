"""How many CTAs of a compiled kernel a device holds at once (the driver's occupancy
calculator). Every CTA of every rank sharing a device must be resident together, or
the gather waits out its spin budget (docs/design.md, "Co-residency").
"""

import functools

import torch

from .kernels.arch import target
from .launch import bind_primary_context, checked, load_function


def device_arch(device) -> str:
    """The compile target of ``device`` (``kernels.arch.target``)."""
    return target(*torch.cuda.get_device_capability(device))


class Resident(int):
    """CTAs the whole device holds (the int, ``per_sm * sms``); ``per_sm`` and ``sms``
    kept so the plan's headroom can be whole SMs (``plan.co_resident_limit``)."""

    def __new__(cls, per_sm: int, sms: int):
        value = super().__new__(cls, per_sm * sms)
        value.per_sm, value.sms = per_sm, sms
        return value

    def __repr__(self):
        return f"Resident({self.per_sm} per SM x {self.sms} SMs = {int(self)})"


@functools.lru_cache(maxsize=None)
def resident_ctas(cubin: bytes, name: str, threads: int, device_index: int,
                  smem: int = 0) -> Resident:
    """``Resident`` CTAs of the cubin's kernel ``name`` (``threads`` per CTA, ``smem``
    bytes of dynamic shared memory). Loaded as the launcher loads it, once per context."""
    from cuda.bindings import driver as cu  # lazy: loads the CUDA driver

    torch.cuda.init()
    with torch.cuda.device(device_index):
        function = load_function(cubin, name, bind_primary_context(device_index), smem)
        per_sm = checked(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, smem),
                         "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return Resident(int(per_sm), int(sms))
