"""The pin of the test bed's CPU ISA handling (tests/engine_cpu.py): the simulated host
really reaches vLLM's choice (so the real-engine modules' ``amx-seen`` branch runs vLLM's
AMX decision, not this machine's), and with the bed's portable paths a real vLLM linear
layer builds and computes on either host. The real-engine modules (test_vllm_real,
test_vllm_firstuse) run every test on both hosts through their fixtures' ``host_isa``."""

import pytest
from engine_cpu import HOST_ISAS, portable_paths, simulate_host
from helpers import VLLM_RELEASES
from spawn import spawn


def _choice(rank, world, isa):
    import os

    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    simulate_host(isa)
    import torch
    from vllm.model_executor.layers import utils

    shape = (256, 512)  # N, K: whole AMX tiles, a small weight
    asked = {"amx": torch.cpu._is_amx_tile_supported(),
             "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
             "vllm_packed": utils.check_cpu_sgl_kernel(*shape, torch.bfloat16)}
    portable_paths()
    asked["vllm_packed_in_bed"] = utils.check_cpu_sgl_kernel(*shape, torch.bfloat16)
    layer = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(3, shape[1], dtype=torch.bfloat16)
    got = utils.cpu_unquantized_gemm(layer, x, layer.weight)
    asked["linear_equal"] = bool(torch.equal(got, torch.nn.functional.linear(x, layer.weight)))
    return asked


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_the_simulated_host_reaches_vllms_choice_and_the_bed_builds(isa, tmp_path,
                                                                    vllm_release):
    (asked,) = spawn(_choice, 1, tmp_path, isa, group=False)
    seen = isa == "amx-seen"
    # what an AMX host's vLLM does: the packed-weight kernel, absent from the wheel we install
    assert asked["amx"] is seen and asked["avx512_bf16"] is seen
    assert asked["vllm_packed"] is seen
    # the bed: the portable torch path, whatever the host, and it computes
    assert asked["vllm_packed_in_bed"] is False
    assert asked["linear_equal"] is True


def test_every_release_of_the_window_has_its_quirks_named():
    """engine_cpu's table of release quirks covers exactly the window (a release added to
    VLLM_RELEASES must say what its CPU build needs, even if nothing)."""
    from engine_cpu import VLLM_RELEASE_QUIRKS

    assert sorted(VLLM_RELEASE_QUIRKS) == sorted(VLLM_RELEASES)


def test_an_unknown_host_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        simulate_host("sse2-only")
