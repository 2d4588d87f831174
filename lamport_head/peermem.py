"""Peer memory of the ``ipc`` mailbox: each rank's box is a cuMem allocation of its own GPU,
exported as a file descriptor; every peer maps it in its own context, granting access to
its own device only (no driver call names another device). An import holds its
reference and mapping until ``close()``, so a dead peer's pages never become another
process's memory while survivors may still store into them. GPUs are named by UUID."""

import array
import contextlib
import ctypes
import mmap
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass

import torch

from .launch import bind_primary_context, checked

RECEIVE_WAIT_S = 30.0


@dataclass
class Segment:
    ptr: int
    size: int
    handle: object = None
    fd: int = -1
    keep: object = None  # keeps a host mapping alive (HostSegments)


class CudaSegments:
    """cuMem boxes of this process's device, every call with its primary context current,
    every location ``self.ordinal`` (this device, as its driver numbers it)."""

    def __init__(self, device, driver=None, bind=None):
        self.device = torch.device(device)
        if driver is None:
            from cuda.bindings import driver  # lazy: a GPU process only
        self.cu, self._bind = driver, bind or bind_primary_context
        with self._current():
            self.ordinal = int(checked(self.cu.cuCtxGetDevice(), "cuCtxGetDevice"))
            for attr in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                         "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
                code = getattr(self.cu.CUdevice_attribute, attr)
                if not checked(self.cu.cuDeviceGetAttribute(code, self.ordinal), attr):
                    raise RuntimeError(f"{self.device}: the driver reports no {attr[20:].lower()}"
                                       " (a mailbox is a cuMem allocation shared as a file "
                                       "descriptor)")

    @contextlib.contextmanager
    def _current(self):
        """This device's primary context current, bound explicitly: torch binds it lazily,
        and start-up steps run in helper threads."""
        if self.device.type != "cuda":
            self._bind(self.device.index)
            yield
            return
        with torch.cuda.device(self.device):
            self._bind(self.device.index)
            yield

    def _location(self, holder):
        holder.type = self.cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        holder.id = self.ordinal

    def _map(self, handle, size):
        cu = self.cu
        ptr = int(checked(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve"))
        try:
            checked(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
            try:
                access = cu.CUmemAccessDesc()
                self._location(access.location)
                access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                checked(cu.cuMemSetAccess(ptr, size, [access], 1), "cuMemSetAccess")
            except Exception:
                cu.cuMemUnmap(ptr, size)
                raise
        except Exception:
            cu.cuMemAddressFree(ptr, size)
            raise
        return ptr

    def create(self, nbytes):
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._location(prop.location)
        posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.requestedHandleTypes = posix
        with self._current():
            grain = int(checked(cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity"))
            size = -(-nbytes // grain) * grain
            handle = checked(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
            try:
                ptr = self._map(handle, size)
                try:
                    fd = int(checked(cu.cuMemExportToShareableHandle(handle, posix, 0),
                                 "cuMemExportToShareableHandle"))
                except Exception:
                    cu.cuMemUnmap(ptr, size)
                    cu.cuMemAddressFree(ptr, size)
                    raise
            except Exception:
                cu.cuMemRelease(handle)
                raise
        return Segment(ptr, size, handle, fd)

    def open(self, fd, size):
        cu = self.cu
        with self._current():
            handle = checked(cu.cuMemImportFromShareableHandle(
                fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                "cuMemImportFromShareableHandle")
            try:
                return Segment(self._map(handle, size), size, handle)
            except Exception:
                cu.cuMemRelease(handle)
                raise

    def close(self, segment):
        cu = self.cu
        with self._current():
            cu.cuMemUnmap(segment.ptr, segment.size)
            cu.cuMemAddressFree(segment.ptr, segment.size)
            cu.cuMemRelease(segment.handle)
        if segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    def tensor(self, segment, count):
        """``count`` int32 words at the segment, a tensor that does not own the memory."""
        if hasattr(self.cu, "tensor"):
            return self.cu.tensor(segment.ptr, count)
        return torch.as_tensor(_CudaArray(segment.ptr, count), device=self.device)


class _CudaArray:
    def __init__(self, ptr, count):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<i4",
                                         "data": (int(ptr), False), "version": 2,
                                         "strides": None}


class HostSegments:
    """The same contract over memfd shared memory, for CPU-device mailboxes."""

    ordinal = -1

    def create(self, nbytes):
        fd = os.memfd_create("lamport-head-box")
        os.ftruncate(fd, nbytes)
        return self._mapped(fd, nbytes, exported=True)

    def open(self, fd, size):
        return self._mapped(fd, size, exported=False)

    @staticmethod
    def _mapped(fd, size, exported):
        view = mmap.mmap(fd, size)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        return Segment(ptr, size, fd=fd if exported else -1, keep=view)

    def close(self, segment):
        segment.keep = None  # the mapping goes with the last tensor over it
        if segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    def tensor(self, segment, count):
        return torch.frombuffer(segment.keep, dtype=torch.int32, count=count)


def segments_for(device):
    return CudaSegments(device) if torch.device(device).type == "cuda" else HostSegments()


class FdChannel:
    """This process's inbox for its peers' descriptors: an abstract Unix datagram socket,
    bound before the ranks exchange names. Every descriptor received stays in ``_got``
    until ``receive`` hands it out or ``close`` closes it."""

    def __init__(self):
        self.name = f"\0lamport-head-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.name)
        self._got = {}

    def send(self, to, rank, fd):
        """``fd`` to the inbox named ``to``, from ``rank``, without waiting: BlockingIOError
        (or TimeoutError) when that inbox is full."""
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        self.sock.sendmsg([struct.pack("<i", rank)], rights, socket.MSG_DONTWAIT, to)

    def send_all(self, targets, rank, fd, wait_s=RECEIVE_WAIT_S):
        """``fd`` to every inbox of ``targets``. Every rank sends before any receives and
        an inbox holds about ten messages, so a full one is waited out while this rank
        reads its own. RuntimeError naming the peers not reached in ``wait_s``."""
        pending, end = dict(targets), time.monotonic() + wait_s
        while pending:
            for peer, name in list(pending.items()):
                try:
                    self.send(name, rank, fd)
                    del pending[peer]
                except (BlockingIOError, TimeoutError):
                    pass
            if pending:
                if time.monotonic() > end:
                    raise RuntimeError(f"could not hand this mailbox's descriptor to rank(s) "
                                       f"{sorted(pending)} within {wait_s:g} s (inbox full)")
                self._take(0.001)

    def _take(self, wait_s):
        self.sock.settimeout(max(wait_s, 1e-6))
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, 4, 1)
        except socket.timeout:
            return False
        if len(msg) != 4 or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return True
        (rank,) = struct.unpack("<i", msg)
        if rank in self._got:
            os.close(fds[0])
        else:
            self._got[rank] = fds[0]
        return True

    def receive(self, ranks, wait_s=RECEIVE_WAIT_S):
        """``{rank: fd}`` from each of ``ranks`` (the caller's to close) within ``wait_s``."""
        want, end = set(ranks), time.monotonic() + wait_s
        while not want <= self._got.keys():
            left = end - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no mailbox descriptor from rank(s) "
                                   f"{sorted(want - self._got.keys())} within {wait_s:g} s")
            self._take(left)
        return {r: self._got.pop(r) for r in sorted(want)}

    def close(self):
        for fd in self._got.values():
            os.close(fd)
        self._got = {}
        self.sock.close()


_P2P_WRITE, _P2P_ATOMICS = 1, 3  # nvmlGpuP2PCapsIndex_t
_P2P_STATUS = {0: "ok", 1: "chipset not supported", 2: "GPU not supported",
               3: "IOH topology not supported", 4: "disabled by regkey", 5: "not supported",
               6: "unknown"}


def _nvml():
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    if lib.nvmlInit_v2() != 0:
        raise RuntimeError("nvmlInit failed")
    return lib


def nvml_uuid(uuid):
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def p2p_status(a, b, nvml=None):
    """``(ok, why)``: whether GPU ``a`` can store into and do atomics on ``b``'s memory, asked
    of NVML (which sees every GPU of the host); ``ok`` is None when NVML cannot tell."""
    try:
        lib = nvml or _nvml()
        handles = []
        for uuid in (a, b):
            handle = ctypes.c_void_p()
            code = lib.nvmlDeviceGetHandleByUUID(nvml_uuid(uuid).encode(), ctypes.byref(handle))
            if code != 0:
                return None, f"NVML knows no GPU {nvml_uuid(uuid)} (error {code})"
            handles.append(handle)
        for index, what in ((_P2P_WRITE, "peer stores"), (_P2P_ATOMICS, "peer atomics")):
            status = ctypes.c_int()
            code = lib.nvmlDeviceGetP2PStatus(handles[0], handles[1], index, ctypes.byref(status))
            if code != 0:
                return None, f"NVML could not tell (error {code})"
            if status.value != 0:
                return False, f"no {what}: {_P2P_STATUS.get(status.value, status.value)}"
        return True, ""
    except (OSError, RuntimeError, AttributeError) as exc:  # no library, no init, no symbol
        return None, f"NVML unavailable ({exc})"


__all__ = ["CudaSegments", "HostSegments", "FdChannel", "Segment", "segments_for",
           "p2p_status", "nvml_uuid", "RECEIVE_WAIT_S"]
