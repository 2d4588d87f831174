"""``DriverLaunch``: a compiled gather launched straight through the CUDA driver
(``cuLaunchKernelEx`` from the cubin, arguments kept in ctypes memory), so an eager
decode step pays no per-call argument marshalling.

Invariants a change must keep:

- The argument slots follow the kernel's parameters exactly (``PARAMS``);
  ``kernel_entry`` checks count and widths against the PTX ``.entry`` (a swap of two
  of one width is caught by the bitwise GPU tests, not here).
- A PDL kernel launches with programmatic stream serialization, others plainly.
- The kernel loads into the context current when the launcher is built. Only
  CUDA_ERROR_INVALID_HANDLE and INVALID_CONTEXT are retried, once, with that context
  pushed; any other code raises: launching a collective twice would put this rank a
  call ahead.
- One launcher serves one caller at a time (its slots are rewritten per call).
- ``serving`` is fixed when the launcher is built (one gather, one mode).
- The compiled kernel's mode picks the slots: ``PARAMS`` for the gather,
  ``ALL_TO_ALL_PARAMS`` (the same, then ``MAX_TP + 1`` row offsets) for the
  all-to-all; every launch of the all-to-all writes all of its offsets, which its
  caller checked (``check_offsets``): the launcher copies them as they are.
"""

import ctypes
import functools
import re

from .kernels.protocol import MAX_TP

# The kernel's parameters, in order (``Gather.kernel``): the shard's address, its
# rows (M), the output's address, the peer table's, the rank, the spin budget (ns),
# the status record's address and ``serving`` (1: serving's give-up, 0: the
# recoverable one; ``protocol``).
PARAMS = (("shard", ctypes.c_uint64), ("rows", ctypes.c_int32), ("out", ctypes.c_uint64),
          ("peers", ctypes.c_uint64), ("rank", ctypes.c_int32), ("budget", ctypes.c_int64),
          ("status", ctypes.c_uint64), ("serving", ctypes.c_int32))
# The all-to-all's (``Gather(all_to_all=True)``): the gather's, then the row offsets
# (prefix sums of the splits, ``offset0`` = 0); a launch for tp ranks fills the tail
# past ``offset{tp}`` with M, which the kernel never reads.
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
    """The row offsets of an all-to-all launch, refused (ValueError) unless they are
    ``tp + 1`` non-decreasing ints from 0 to ``rows``: rows routed past the last offset
    would land in a peer's box where no poll re-arms them, and a later call of that
    parity would deliver them as valid. The splits' agreement across ranks and their
    fit in the mailbox are the caller's to check."""
    offsets = tuple(offsets)
    if (len(offsets) != tp + 1 or offsets[0] != 0 or offsets[-1] != rows
            or any(b < a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"an all-to-all launch of {rows} rows over {tp} ranks takes tp + 1 "
                         f"non-decreasing row offsets from 0 to {rows}, got {offsets!r}")
    return offsets


def kernel_entry(ptx: str, params=PARAMS) -> str:
    """The name of the PTX's one kernel, after checking that its parameters are
    ``params`` (count and widths); ValueError otherwise."""
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
    """The argument slots of ``compiled``'s mode: ``ALL_TO_ALL_PARAMS`` for an
    all-to-all kernel (``compiled.all_to_all``), ``PARAMS`` otherwise."""
    return ALL_TO_ALL_PARAMS if getattr(compiled, "all_to_all", False) else PARAMS


def kernel_name(compiled) -> str:
    """``kernel_entry`` of ``compiled``'s PTX against its mode's slots: the one check
    every host path runs before loading the cubin (the launcher, the occupancy query)."""
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
    """The value of a ``cuda.bindings`` driver call's ``(status, value...)`` (None for a
    call that returns none); RuntimeError naming ``what`` and the status otherwise."""
    status, *values = result
    if int(status) != 0:  # CUDA_SUCCESS
        raise RuntimeError(f"{what} failed: {status}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


@functools.lru_cache(maxsize=None)
def load_function(cubin: bytes, name: str, context: int, smem: int = 0) -> int:
    """The CUfunction of kernel ``name`` of ``cubin`` in the current context
    (``context``: its handle, a cache key), loaded once per process and shared by the
    occupancy check and the launcher; allowed ``smem`` bytes of dynamic shared memory
    (ValueError when the device has fewer per CTA)."""
    from cuda.bindings import driver as cu  # lazy: loads the CUDA driver

    library = checked(cu.cuLibraryLoadData(cubin, [], [], 0, [], [], 0), "cuLibraryLoadData")
    kernel = checked(cu.cuLibraryGetKernel(library, name.encode()), "cuLibraryGetKernel")
    function = checked(cu.cuKernelGetFunction(kernel), "cuKernelGetFunction")
    if smem:
        # Always for a staged kernel, not only above the 48 KiB default: the static
        # shared memory the cubin declares (1 KiB on sm_90a, ``cuobjdump -res-usage``:
        # SHARED:1024) counts against that default too, so 47-48 KiB of slots would
        # fail to launch without it.
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (status,) = cu.cuFuncSetAttribute(function, attribute, smem)
        if status != cu.CUresult.CUDA_SUCCESS:  # more than the device has per CTA
            raise ValueError(f"the gather's kernel needs {smem} bytes of shared memory per CTA "
                             f"(threads x unroll x 16: staged batches), more than this device "
                             f"allows ({status}): use fewer threads or a smaller unroll")
    return int(function)


def bind_primary_context(index: int) -> int:
    """Make device ``index``'s primary context (the one torch's runtime uses) current on
    the calling thread, and return it. Torch makes it current lazily, at its first
    runtime call that needs one: switching torch's current device or stream does not,
    so a thread whose first CUDA work is a driver call (load a kernel, map a mailbox)
    binds it here first, as vLLM's cuMem allocator does."""
    from cuda.bindings import driver as cu  # lazy: loads the CUDA driver

    checked(cu.cuInit(0), "cuInit")
    device = checked(cu.cuDeviceGet(index), "cuDeviceGet")
    context = checked(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    checked(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return int(context)


def current_context() -> int:
    """The calling thread's current CUDA context handle (0: none)."""
    handle = ctypes.c_void_p()
    code = _driver().cuCtxGetCurrent(ctypes.byref(handle))
    if code:
        raise RuntimeError(f"cuCtxGetCurrent failed: {_error(code)}")
    return handle.value or 0


class DriverLaunch:
    """``launch(shard, out, peers, rank, ctas, budget, status, stream)``: the DSL
    callable's arguments but ``serving`` (``shard`` a contiguous, 16-byte aligned tensor
    of any 16-bit or 32-bit dtype, read by address and rows only; the rest ints) plus ``stream``, the raw ``cudaStream_t`` to launch on.
    ``serving`` (bool) is this launcher's: every launch passes it (``PARAMS``). Build it
    with the device's context current (``__init__`` loads the kernel there).
    ``pdl=False`` launches a PDL kernel without the attribute (diagnostics: its wait is
    then a no-op, the stream serializes it fully). An all-to-all kernel
    (``compiled.all_to_all``) takes ``offsets`` too: the tp + 1 row offsets."""

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
        if self.all_to_all:  # the offsets' slots, consecutive int32: written as one array
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
        self.refusals = 0  # launches the driver refused (tests: the retry path ran)

    def __call__(self, shard, out, peers, rank, ctas, budget, status, stream, offsets=()):
        v = self._values
        v.shard, v.rows, v.out, v.peers = shard.data_ptr(), shard.shape[0], out, peers
        v.rank, v.budget, v.status = rank, budget, status
        if self.all_to_all:  # checked by the caller (``check_offsets``), once per call
            n = len(offsets)
            self._offsets[:n] = offsets
            self._offsets[n:] = (offsets[-1],) * (MAX_TP + 1 - n)
        self._config.gridDimX, self._config.hStream = ctas, stream
        code = self._launch(*self._args)
        if code:
            self._failed(code)

    def _failed(self, code):
        """A launch the driver refused: once more with the kernel's context pushed when
        the refusal names the context or handle and the calling thread has another
        one (or none) current; else raise."""
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
