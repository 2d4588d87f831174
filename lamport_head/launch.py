"""``DriverLaunch``: a compiled kernel launched straight through ``cuLaunchKernelEx``, its
arguments kept in ctypes memory (no per-call marshalling). The slots follow the kernel's
parameters exactly (``kernel_entry`` checks count and widths). Only an invalid context or
handle is retried, once, with the kernel's context pushed: launching a collective twice
would put this rank a call ahead. One launcher serves one caller at a time."""

import ctypes
import functools
import re

from .kernels.protocol import MAX_TP

# ``Gather.kernel``'s parameters, in order
PARAMS = (("shard", ctypes.c_uint64), ("rows", ctypes.c_int32), ("out", ctypes.c_uint64),
          ("peers", ctypes.c_uint64), ("rank", ctypes.c_int32), ("budget", ctypes.c_int64),
          ("status", ctypes.c_uint64), ("serving", ctypes.c_int32))
# the all-to-all's: then the row offsets; the tail past ``offset{tp}`` is M, never read
ALL_TO_ALL_PARAMS = PARAMS + tuple((f"offset{q}", ctypes.c_int32) for q in range(MAX_TP + 1))
_PTX_WIDTH = {".u64": 8, ".s64": 8, ".b64": 8, ".u32": 4, ".s32": 4, ".b32": 4}
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_RETRIED = (201, 400)  # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE


class _Values(ctypes.Structure):
    _fields_ = list(PARAMS)


class _AllToAllValues(ctypes.Structure):
    _fields_ = list(ALL_TO_ALL_PARAMS)


class _AttributeValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes, 8-byte aligned
    _fields_ = [("programmaticStreamSerializationAllowed", ctypes.c_int32),
                ("align", ctypes.c_uint64), ("pad", ctypes.c_byte * 64)]


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, the value union
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_byte * 4),
                ("value", _AttributeValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint32), ("gridDimY", ctypes.c_uint32),
                ("gridDimZ", ctypes.c_uint32), ("blockDimX", ctypes.c_uint32),
                ("blockDimY", ctypes.c_uint32), ("blockDimZ", ctypes.c_uint32),
                ("sharedMemBytes", ctypes.c_uint32), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint32)]


def check_offsets(offsets, tp: int, rows: int):
    """``offsets`` as a tuple; ValueError unless ``tp + 1`` non-decreasing ints from 0 to
    ``rows``: rows past the last offset would land where no poll re-arms them, and a later
    call of that parity would deliver them."""
    offsets = tuple(offsets)
    if (len(offsets) != tp + 1 or offsets[0] != 0 or offsets[-1] != rows
            or any(b < a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"an all-to-all launch of {rows} rows over {tp} ranks takes tp + 1 "
                         f"non-decreasing row offsets from 0 to {rows}, got {offsets!r}")
    return offsets


def kernel_entry(ptx: str, params=PARAMS) -> str:
    """The PTX's one kernel's name; ValueError unless its parameters have ``params``' widths."""
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise ValueError(f"expected one .entry in the gather's PTX, found {len(entries)}")
    name, declared = entries[0]
    widths = [_PTX_WIDTH.get(t) for t in re.findall(r"\.param\s+(\.\w+)", declared)]
    want = [ctypes.sizeof(c) for _, c in params]
    if widths != want:
        raise ValueError(f"the kernel's parameters have widths {widths}, the launcher's "
                         f"slots {want} ({', '.join(n for n, _ in params)})")
    return name


def slots(compiled):
    return ALL_TO_ALL_PARAMS if getattr(compiled, "all_to_all", False) else PARAMS


def kernel_name(compiled) -> str:
    """``kernel_entry`` of ``compiled``: every host path's check before loading the cubin."""
    return kernel_entry(compiled.ptx, slots(compiled))


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    for name, args in (("cuLaunchKernelEx", 4), ("cuCtxPushCurrent_v2", 1),
                       ("cuCtxPopCurrent_v2", 1), ("cuCtxGetCurrent", 1)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.c_void_p] * args, ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.cuGetErrorName.restype = ctypes.c_int
    return lib


def _error(code) -> str:
    name = ctypes.c_char_p()
    if _driver().cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return f"{name.value.decode()} ({code})"
    return f"CUresult {code}"


def checked(result, what):
    """The value(s) of a ``cuda.bindings`` call's result; RuntimeError naming ``what``."""
    status, *values = result
    if int(status) != 0:
        raise RuntimeError(f"{what} failed: {status}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


@functools.lru_cache(maxsize=None)
def load_function(cubin: bytes, name: str, context: int, smem: int = 0) -> int:
    """The CUfunction of ``name`` in ``cubin``, loaded once per context, allowed ``smem`` bytes
    of dynamic shared memory (ValueError when the device has fewer per CTA)."""
    from cuda.bindings import driver as cu  # lazy: loads the CUDA driver

    library = checked(cu.cuLibraryLoadData(cubin, [], [], 0, [], [], 0), "cuLibraryLoadData")
    kernel = checked(cu.cuLibraryGetKernel(library, name.encode()), "cuLibraryGetKernel")
    function = checked(cu.cuKernelGetFunction(kernel), "cuKernelGetFunction")
    if smem:
        # also below the 48 KiB default: the cubin's static shared memory counts against it
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (status,) = cu.cuFuncSetAttribute(function, attribute, smem)
        if status != cu.CUresult.CUDA_SUCCESS:
            raise ValueError(f"the gather's kernel needs {smem} bytes of shared memory per CTA "
                             f"(threads x unroll x 16: staged batches), more than this device "
                             f"allows ({status}): use fewer threads or a smaller unroll")
    return int(function)


def bind_primary_context(index: int) -> int:
    """Make device ``index``'s primary context current on this thread and return it: torch
    binds it lazily, so a thread whose first CUDA work is a driver call binds it here."""
    from cuda.bindings import driver as cu

    checked(cu.cuInit(0), "cuInit")
    device = checked(cu.cuDeviceGet(index), "cuDeviceGet")
    context = checked(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    checked(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return int(context)


def current_context() -> int:
    handle = ctypes.c_void_p()
    code = _driver().cuCtxGetCurrent(ctypes.byref(handle))
    if code:
        raise RuntimeError(f"cuCtxGetCurrent failed: {_error(code)}")
    return handle.value or 0


class DriverLaunch:
    """``launch(shard, out, peers, rank, ctas, budget, status, stream[, offsets])``, with
    ``serving`` fixed per launcher; build it with the device's context current. ``pdl=False``
    drops PDL's attribute (diagnostics)."""

    def __init__(self, compiled, pdl=None, *, serving):
        params = slots(compiled)
        self.all_to_all = params is ALL_TO_ALL_PARAMS
        self.tp = getattr(compiled, "tp", 0)
        values = _AllToAllValues if self.all_to_all else _Values
        self.name = kernel_name(compiled)
        self.context = current_context()
        if not self.context:
            raise RuntimeError("DriverLaunch: no CUDA context is current (make the device's "
                               "primary context current first)")
        self.smem = compiled.smem
        self.function = load_function(bytes(compiled.cubin), self.name, self.context, self.smem)
        self.pdl = compiled.pdl if pdl is None else bool(pdl) and compiled.pdl
        self._values = values()
        self.serving = self._values.serving = int(bool(serving))
        base = ctypes.addressof(self._values)
        self._params = (ctypes.c_void_p * len(params))(
            *(base + getattr(values, n).offset for n, _ in params))
        if self.all_to_all:  # consecutive int32 slots, written as one array
            self._offsets = (ctypes.c_int32 * (MAX_TP + 1)).from_address(
                base + _AllToAllValues.offset0.offset)
        self._attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attribute.value.programmaticStreamSerializationAllowed = 1
        self._config = _Config(gridDimY=1, gridDimZ=1, blockDimX=compiled.threads, blockDimY=1,
                               blockDimZ=1, sharedMemBytes=self.smem,
                               attrs=ctypes.addressof(self._attribute) if self.pdl else None,
                               numAttrs=1 if self.pdl else 0)
        self._args = (ctypes.addressof(self._config), self.function,
                      ctypes.addressof(self._params), None)
        self._launch = _driver().cuLaunchKernelEx
        self.refusals = 0

    def __call__(self, shard, out, peers, rank, ctas, budget, status, stream, offsets=()):
        v = self._values
        v.shard, v.rows, v.out, v.peers = shard.data_ptr(), shard.shape[0], out, peers
        v.rank, v.budget, v.status = rank, budget, status
        if self.all_to_all:  # unchecked here: every caller runs check_offsets first
            n = len(offsets)
            self._offsets[:n] = offsets
            self._offsets[n:] = (offsets[-1],) * (MAX_TP + 1 - n)
        self._config.gridDimX, self._config.hStream = ctas, stream
        code = self._launch(*self._args)
        if code:
            self._failed(code)

    def _failed(self, code):
        lib = _driver()
        self.refusals += 1
        if code in _RETRIED and current_context() != self.context:
            if lib.cuCtxPushCurrent_v2(self.context) == 0:
                try:
                    code = self._launch(*self._args)
                finally:
                    lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
                if not code:
                    return
        raise RuntimeError(f"lamport-head: launching the gather ({self._config.gridDimX} CTAs) "
                           f"failed: {_error(code)}")
