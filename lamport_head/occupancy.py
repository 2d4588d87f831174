"""How many CTAs of a compiled kernel a device holds at once (the driver's occupancy
calculator), for ``plan.co_resident_limit``."""

import functools

import torch

from .kernels.arch import target
from .launch import bind_primary_context, checked, load_function


def device_arch(device) -> str:
    return target(*torch.cuda.get_device_capability(device))


class Resident(int):
    """CTAs the device holds (the int); ``per_sm`` and ``sms`` let headroom be whole SMs."""

    def __new__(cls, per_sm: int, sms: int):
        value = super().__new__(cls, per_sm * sms)
        value.per_sm, value.sms = per_sm, sms
        return value

    def __repr__(self):
        return f"Resident({self.per_sm} per SM x {self.sms} SMs = {int(self)})"


@functools.lru_cache(maxsize=None)
def resident_ctas(cubin: bytes, name: str, threads: int, device_index: int,
                  smem: int = 0) -> Resident:
    """``Resident`` CTAs of the cubin's kernel ``name``, loaded as the launcher loads it."""
    from cuda.bindings import driver as cu

    torch.cuda.init()
    with torch.cuda.device(device_index):
        function = load_function(cubin, name, bind_primary_context(device_index), smem)
        per_sm = checked(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, smem),
                         "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return Resident(int(per_sm), int(sms))
