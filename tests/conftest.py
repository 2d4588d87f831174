import os

import pytest

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


@pytest.fixture(autouse=True)
def _own_user_table(tmp_path_factory, monkeypatch):
    """Tests never read or write the developer's user table (~/.cache/lamport-head)."""
    monkeypatch.setenv("LAMPORT_HEAD_CACHE", str(tmp_path_factory.mktemp("cache")))
    # Installs measure nothing unless a test asks (tests/test_autotune.py does).
    monkeypatch.setenv("LAMPORT_HEAD_AUTOTUNE", "0")


def pytest_report_header(config):
    from helpers import VLLM_RELEASES, installed_vllm

    return (f"vllm: {installed_vllm() or 'not installed'} (the real-vLLM tests' releases: "
            f"{', '.join(VLLM_RELEASES)})")


def pytest_generate_tests(metafunc):
    # Each real-vLLM test's id names the release it ran on (``[vllm-0.34.0]``): the suite
    # runs once per release, each in its own venv, and a report must say which ran.
    if "vllm_release" in metafunc.fixturenames:
        from helpers import installed_vllm

        found = installed_vllm()
        metafunc.parametrize("vllm_release", [found], indirect=True, scope="session",
                             ids=[f"vllm-{found or 'absent'}"])


@pytest.fixture(scope="session")
def vllm_release(request):
    """The installed vLLM release, one of the window (helpers.require_vllm: else skip, or
    fail under LAMPORT_HEAD_REQUIRE_VLLM=1)."""
    from helpers import require_vllm

    return require_vllm()


def _cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:  # `-m vllm`: a second release's venv runs these alone
        if "vllm_release" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
