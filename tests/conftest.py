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


def _cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
