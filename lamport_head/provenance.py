"""What a timing depends on besides the GPU model, a section's provenance block, and
staleness (docs/design.md, "Compatibility promise"): a user-table section is stale when one
of ``STALE_KEYS`` differs from this process's. Imports no kernel, optuna or CUDA context.
"""

import datetime
import hashlib
import importlib.metadata
import importlib.util
import subprocess
from pathlib import Path

import torch

from .settings import commit_override

STALE_KEYS = ("driver", "torch", "cutlass_dsl", "lamport_head", "kernel")


def digest(*parts, size=12):
    """Hex digest of byte strings, length-prefixed so that no two splits collide."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:size]


def _run(*cmd, cwd=None):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                              cwd=cwd or Path(__file__).resolve().parent).stdout.strip()
    except Exception:
        return ""


# a tree that differs from its commit here is not that commit's code
CODE_DIRS = ("lamport_head", "kernels", "tuning")


def source_commit(package=None):
    """The commit of this package's checkout (``+dirty`` when ``CODE_DIRS`` differ); None
    when it is not a checkout's own ``lamport_head`` (a wheel, a venv in another repo)."""
    package = Path(package or Path(__file__).resolve().parent).resolve()
    top = _run("git", "rev-parse", "--show-toplevel", cwd=package)
    if not top or (Path(top) / "lamport_head").resolve() != package:
        return None
    head = _run("git", "rev-parse", "--short=12", "HEAD", cwd=top)
    if not head:
        return None
    dirty = _run("git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_DIRS,
                 cwd=top)
    return head + ("+dirty" if dirty else "")


def _version(name, missing="unknown"):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return missing


def kernel_identity(sources=None):
    """12 hex digits naming a kernel build: the kernels' ``*.py`` files and the DSL
    version. Reads the files: importing the package would import cutlass."""
    if sources is None:
        sources = importlib.util.find_spec("lamport_head.kernels").submodule_search_locations
    elif isinstance(sources, (str, Path)):
        sources = [sources]
    parts = []
    for directory in sources:
        for path in sorted(Path(directory).glob("*.py")):
            parts += [path.name.encode(), path.read_bytes()]
    try:
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        dsl = "absent"
    return digest(*parts, f"nvidia-cutlass-dsl {dsl}".encode())


def runtime_facts():
    driver = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    return {
        "driver": driver.splitlines()[0] if driver else "unknown",
        "cuda": torch.version.cuda or "unknown",
        "torch": str(torch.__version__),
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "lamport_head": _version("lamport-head", "0+unknown"),
        "kernel": kernel_identity(),
    }


def now():
    """The provenance block's date: UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def provenance(device, command, *, name=None, facts=None, date=None):
    return {
        "gpu": name or torch.cuda.get_device_name(device),
        **(facts if facts is not None else runtime_facts()),
        "date": date or now(),
        "commit": source_commit() or commit_override() or "unknown",
        "command": command,
    }


_FACTS = None


def facts():
    """This process's ``runtime_facts()``, computed once (it runs nvidia-smi)."""
    global _FACTS
    if _FACTS is None:
        _FACTS = runtime_facts()
    return _FACTS


