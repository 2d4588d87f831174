"""lamport-head: the tensor-parallel logits gather of LLM decode on a Lamport mailbox.
Public names: ``__all__`` (docs/design.md, "The public contract"), loaded lazily so that
``import lamport_head`` needs no GPU and no engine."""

import importlib
import importlib.metadata

try:
    __version__ = importlib.metadata.version("lamport-head")
except importlib.metadata.PackageNotFoundError:
    __version__ = "0+unknown"

_LAZY = {
    "HeadGather": ("head_gather", "HeadGather"),
    "AllToAll": ("all_to_all", "AllToAll"),
    "GatherTimeout": ("status", "GatherTimeout"),
    "install_logits_gather": ("engines.vllm", "install_logits_gather"),
    "install_sglang_logits_gather": ("engines.sglang", "install_sglang_logits_gather"),
    "Outcome": ("outcome", "Outcome"),
    "Reason": ("outcome", "Reason"),
}

__all__ = [*_LAZY, "table"]


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    if name == "table":
        return importlib.import_module(".table", __name__)
    raise AttributeError(f"module 'lamport_head' has no attribute {name!r}")
