#!/usr/bin/env bash
# torch 2.13.0, CPU build, into the active Python (`python` on PATH): the test bed's torch.
#
# An ordinary machine's `pip install torch==2.13.0` takes PyPI's wheel, a CUDA build of
# several GB (Linux, x86-64 and aarch64). So: first ask pip, without downloading any
# wheel, what its configured sources offer (`--dry-run --report`: the index's metadata
# only); if that is a CPU build (local version "+cpu": a wheel on local disk, a local
# index or mirror, as on our CI), install exactly that; otherwise install from PyTorch's
# CPU index. Either way the requirement is `torch==2.13.0+cpu`, which no CUDA build
# matches. macOS: PyPI's wheels are CPU builds (no "+cpu" label), taken as they are.
# Usage: scripts/install-torch-cpu.sh [VERSION]   (default 2.13.0)
set -euo pipefail
version=${1:-2.13.0}
cpu_index=https://download.pytorch.org/whl/cpu
# pip, its notes about configured local indexes that lack a package left out
pip_() { python -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; } >&2; }

have=$(python -W ignore -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [ "$(uname -s)" = Darwin ]; then
    [ "$have" = "$version" ] || pip_ install -q "torch==$version"
    echo "install-torch-cpu: torch $version (macOS: PyPI's build is the CPU one)" >&2
    exit 0
fi
if [ "$have" = "$version+cpu" ]; then
    echo "install-torch-cpu: torch $have already installed" >&2
    exit 0
fi
report=$(mktemp)
trap 'rm -f "$report"' EXIT
python -m pip install -q --dry-run --ignore-installed --no-deps --only-binary :all: \
    --report "$report" "torch==$version" 2>/dev/null || true
offered=$(python - "$report" <<'PY'
import json, sys
try:
    items = json.load(open(sys.argv[1]))["install"]
except Exception:
    items = []
print(next((i["metadata"]["version"] for i in items
            if i["metadata"]["name"].lower() == "torch"), ""))
PY
)
if [ "$offered" = "$version+cpu" ]; then
    pip_ install -q --only-binary :all: "torch==$version+cpu"
    echo "install-torch-cpu: torch $version+cpu from pip's configured sources" >&2
else
    echo "install-torch-cpu: pip's configured sources offer torch ${offered:-nothing}" \
         "(not a CPU build): taking $version+cpu from $cpu_index" >&2
    pip_ install -q --only-binary :all: --index-url "$cpu_index" "torch==$version+cpu"
fi
python -W ignore -c "import torch, sys; v = torch.__version__; sys.exit(0 if v == '$version+cpu' else f'install-torch-cpu: got torch {v}')"
