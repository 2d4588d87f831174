"""A stand-in for ``cuda.bindings.driver``'s cuMem calls, for ``peermem.CudaSegments`` on
a machine with no GPU: one "device" per process (an ordinal, as this process numbers it,
and a UUID), whose memory is memfd shared memory really mapped at the reserved address,
so boxes are shared between processes as the driver shares them. It records every device
a call names and, for each import, the exporter's device (carried in the memfd's name),
so a test can pin that every mapping is made for the importer's own device."""

import ctypes
import functools
import os
import threading
import types

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_NONE, PROT_RW = 0, 3
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
GRAIN = 4096


def _mmap(addr, size, prot, flags, fd):
    ptr = _libc.mmap(addr, size, prot, flags, fd, 0)
    if ptr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return ptr


class FakeDriver:
    """Module-shaped: the enums, structs and ``cuMem*`` calls ``CudaSegments`` uses."""

    CUdevice_attribute = types.SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102,
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED=103)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemAllocationHandleType = types.SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)

    def __init__(self, ordinal, uuid):
        self.ordinal, self.uuid = ordinal, uuid
        self.named = []  # (call, device ordinal named)
        self.imports = []  # the exporter's UUID of each import
        self.live = {}  # mapped address -> size
        self._bound = threading.local()  # as a CUDA context: current per thread
        for name in dir(self):  # every driver call needs this thread's context, as CUDA's do
            if name.startswith("cu") and name not in ("cuCtxGetDevice",):
                setattr(self, name, self._needs_context(getattr(self, name)))

    def bind(self, index):
        """``bind_primary_context``'s stand-in: this thread's context is current."""
        self._bound.yes = True

    def _needs_context(self, call):
        @functools.wraps(call)
        def checked(*args):
            if not getattr(self._bound, "yes", False):
                return (201, None) if call.__name__ != "cuMemUnmap" else (201,)
            return call(*args)

        return checked

    @staticmethod
    def CUmemAllocationProp():
        return types.SimpleNamespace(type=None, requestedHandleTypes=None,
                                     location=types.SimpleNamespace(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc():
        return types.SimpleNamespace(flags=None, location=types.SimpleNamespace(type=None, id=None))

    def cuCtxGetDevice(self):
        if not getattr(self._bound, "yes", False):
            return 201, None  # CUDA_ERROR_INVALID_CONTEXT: none current on this thread
        return 0, self.ordinal

    def cuDeviceGetAttribute(self, attr, device):
        self.named.append(("cuDeviceGetAttribute", device))
        return 0, 1

    def cuMemGetAllocationGranularity(self, prop, flag):
        self.named.append(("cuMemGetAllocationGranularity", prop.location.id))
        return 0, GRAIN

    def cuMemCreate(self, size, prop, flags):
        self.named.append(("cuMemCreate", prop.location.id))
        fd = os.memfd_create(f"fake-cumem:{self.uuid}")
        os.ftruncate(fd, size)
        return 0, types.SimpleNamespace(fd=fd, exporter=self.uuid)

    def cuMemExportToShareableHandle(self, handle, kind, flags):
        return 0, os.dup(handle.fd)

    def cuMemImportFromShareableHandle(self, fd, kind):
        name = os.readlink(f"/proc/self/fd/{fd}")  # "/memfd:fake-cumem:UUID (deleted)"
        exporter = name.split("fake-cumem:", 1)[1].split(" ")[0]
        self.imports.append(exporter)
        return 0, types.SimpleNamespace(fd=os.dup(fd), exporter=exporter)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        return 0, _mmap(None, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        _mmap(ptr, size, PROT_RW, MAP_SHARED | MAP_FIXED, handle.fd)
        self.live[ptr] = size
        return (0,)

    def cuMemSetAccess(self, ptr, size, descs, count):
        for desc in descs[:count]:
            self.named.append(("cuMemSetAccess", desc.location.id))
        return (0,)

    def cuMemUnmap(self, ptr, size):
        _mmap(ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1)
        self.live.pop(ptr, None)
        return (0,)

    def cuMemAddressFree(self, ptr, size):
        _libc.munmap(ptr, size)
        return (0,)

    def cuMemRelease(self, handle):
        os.close(handle.fd)
        return (0,)

    def tensor(self, ptr, count):
        return torch.frombuffer((ctypes.c_char * (count * 4)).from_address(ptr),
                                dtype=torch.int32, count=count)
