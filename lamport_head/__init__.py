"""lamport-head: the tensor-parallel logits gather of LLM decode on a Lamport mailbox.

Public names (``__all__``; docs/design.md's contract lists the same, and
``tests/test_layout.py`` checks it): ``HeadGather``, ``AllToAll``, ``GatherTimeout``,
``install_logits_gather`` and ``install_sglang_logits_gather`` (an ``Outcome``: rows
served, or a ``Reason`` reason and its message), ``table`` (``load_table``, ``Table``,
``TableRow``, ``TableError``). Heavy modules load
lazily so that ``import lamport_head`` is cheap and works without a GPU or vLLM.

``__version__`` is the installed distribution's (pyproject.toml is the one source);
"0+unknown" when the package runs from a tree that was never installed.
"""

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
