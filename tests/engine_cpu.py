"""The engines' CPU instruction-set choices, in one place (the test bed only; the product's
own code never asks what the host CPU has).

Why: the test bed installs vLLM's (and SGLang's) wheels beside a CPU build of torch. The
engines' Python runs, but their compiled CPU ops do not exist there (vLLM's ``torch.ops._C``
of its CPU build, SGLang's ``sgl_kernel``). The engines pick a CPU code path by asking torch
what the host has: vLLM's ``check_cpu_sgl_kernel`` (0.33 and 0.34) answers yes for every
unquantized linear and the lm_head when ``torch.cpu._is_amx_tile_supported()`` does, and the
layer then calls ``torch.ops._C.convert_weight_packed``, absent here. On an Intel AMX host
(Sapphire/Emerald/Granite Rapids: the host CPU of DGX H100/H200 nodes) every real-engine
test errored; on other hosts they passed. So whatever the host says, the classes the tests
build take the engines' portable torch path: ``portable_paths()`` answers "no packed-weight
kernel" at the engines' own decision points, once per process, before any model is built.

The pin (tests/test_engine_cpu_isa.py and the real-engine modules' ``host_isa`` fixture
parameter) runs each real-engine test twice on any machine: once with torch answering
that the host has every optional x86 extension (AMX tiles, AMX-FP16, AVX-512, BF16,
VNNI: what an AMX host reports), once with it answering none (an AVX2-only or Arm host).
``HOST_ISA_ENV`` carries that choice into the spawned ranks; unset, torch answers what
the machine has.

Also here, for the same reason (the engine's CPU build where its CPU worker never starts):
what each vLLM release of the window needs before its classes build (``VLLM_RELEASE_QUIRKS``,
applied by ``prepare_process``), each failing naming this file when vLLM moves it.
"""

import os

HOST_ISA_ENV = "LAMPORT_HEAD_TEST_HOST_ISA"
HOST_ISAS = ("amx-seen", "amx-hidden")

def simulate_host(isa):
    """Make torch answer as a host with every optional x86 extension (``amx-seen``: AMX
    tiles, AMX-BF16/INT8/FP16, AVX-512 with BF16 and VNNI) or none of them (``amx-hidden``:
    an AVX2-only host) would. Torch 2.13's ``torch.cpu._is_*`` queries, which the engines
    call, read ``torch.cpu.get_capabilities()``: that is replaced, and so are the ``_is_*``
    wrappers themselves (other torch versions ask ``torch._C`` directly)."""
    if isa not in HOST_ISAS:
        raise ValueError(f"{HOST_ISA_ENV}={isa!r}: expected one of {HOST_ISAS}")
    from types import MappingProxyType

    import torch

    answer = isa == "amx-seen"
    caps = dict(torch.cpu.get_capabilities())
    optional = {name for name in caps if name.startswith(("amx_", "avx512"))}
    optional |= {"amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "avx512_f", "avx512_bf16",
                 "avx512_vnni", "avx512_bw", "avx512_vl"}
    caps.update({name: answer for name in optional})
    frozen = MappingProxyType(caps)
    torch.cpu.get_capabilities = lambda: frozen
    for name in dir(torch.cpu):
        if name.startswith("_is_") and name.endswith("_supported") and (
                "amx" in name or "avx512" in name or "vnni" in name):
            setattr(torch.cpu, name, lambda answer=answer: answer)


def portable_paths():
    """The engines' ISA-gated CPU choices routed to their portable torch path (see the
    module docstring). Raises when an engine that is installed no longer has the decision
    point patched here: the test bed must follow the engine, not silently stop covering
    it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        import vllm.model_executor.layers.utils as vllm_utils

        if not hasattr(vllm_utils, "check_cpu_sgl_kernel"):
            raise AssertionError("vLLM moved check_cpu_sgl_kernel (its packed-weight CPU GEMM "
                                 "choice): update tests/engine_cpu.py")
        # Every caller looks it up in this module at call time (dispatch_cpu_unquantized_gemm)
        # or imports it after this runs (the quantized linear kernels).
        vllm_utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False


def _vllm_without_triton():
    """vLLM 0.34's ``CpuPlatform.check_and_update_config`` (run by every ``VllmConfig``)
    raises "vLLM on x86 CPUs requires Triton (triton-cpu)" where 0.33 warned: 0.34's only
    x86 CPU runner is the V2 one, whose sampling and input preparation are Triton kernels.
    triton-cpu is not on the registry, and the tests never run a step's Triton kernels
    (they call the model's logits paths and the worker's load_model, plain torch): so the
    check is answered as with Triton, for that call only; everything else keeps asking
    vLLM's real ``HAS_TRITON`` (False)."""
    import inspect

    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__
    source = inspect.getsource(check)
    if "HAS_TRITON" not in source or "requires Triton" not in source:
        raise AssertionError("vLLM moved its x86-needs-Triton decision out of "
                             "CpuPlatform.check_and_update_config: update tests/engine_cpu.py")

    def with_triton(cls, vllm_config):
        import vllm.triton_utils as triton_utils

        had, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
        try:
            return check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = had

    CpuPlatform.check_and_update_config = classmethod(with_triton)


def _vllm_cpu_stand_ins():
    """vLLM 0.34's V2 CPU runner is the GPU runner run on CPU: it makes CUDA streams and
    events and pinned (UVA) buffers, which only work on CPU once ``vllm.v1.worker.cpu.shm``
    has put its stand-ins in torch's and the runner's place. vLLM's ``CPUWorker`` imports
    that module first thing; the tests build the runner under vLLM's GPU ``Worker``
    (CPUWorker's ``__init__`` needs vLLM's C++ extension), so the import is done here, as
    on an x86 host where 0.34 runs (with Triton: the module swaps the runner's UVA buffer
    for its CPU one only then, and 0.34 refuses x86 without Triton, see above)."""
    import importlib
    import importlib.util
    import pathlib

    worker = importlib.util.find_spec("vllm.v1.worker.cpu_worker")
    if (worker is None or "import vllm.v1.worker.cpu.shm"
            not in pathlib.Path(worker.origin).read_text()):
        raise AssertionError("vLLM's CPU worker no longer installs its CUDA stand-ins by "
                             "importing vllm.v1.worker.cpu.shm: update tests/engine_cpu.py")
    import vllm.triton_utils as triton_utils

    had, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
    try:
        importlib.import_module("vllm.v1.worker.cpu.shm")
    finally:
        triton_utils.HAS_TRITON = had
    from vllm.v1.worker.cpu import buffer_utils as cpu_buffers
    from vllm.v1.worker.gpu import buffer_utils as gpu_buffers

    if gpu_buffers.UvaBuffer is not cpu_buffers.UvaBuffer:
        raise AssertionError("vllm.v1.worker.cpu.shm no longer gives the V2 runner its CPU "
                             "UvaBuffer: update tests/engine_cpu.py")


# Per vLLM release of the window (tests/helpers.py VLLM_RELEASES), what its CPU build
# needs beyond the portable paths before any of its classes is built here.
VLLM_RELEASE_QUIRKS = {
    "0.33.0": (),
    "0.34.0": (_vllm_without_triton, _vllm_cpu_stand_ins),
}


def release_quirks():
    """The installed vLLM release's CPU quirks (``VLLM_RELEASE_QUIRKS``), applied in this
    process. A release the table does not know fails: what it needs is unknown."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("vllm")
    except PackageNotFoundError:
        return
    if release not in VLLM_RELEASE_QUIRKS:
        raise AssertionError(f"vLLM {release}: its CPU quirks are not known: add it to "
                             "VLLM_RELEASE_QUIRKS in tests/engine_cpu.py")
    for quirk in VLLM_RELEASE_QUIRKS[release]:
        quirk()


def prepare_process():
    """In a spawned engine rank, first thing: the simulated host (if the pin asked for
    one), then the portable paths and the installed vLLM release's quirks."""
    isa = os.environ.get(HOST_ISA_ENV)
    if isa:
        simulate_host(isa)
    portable_paths()
    release_quirks()
