#!/usr/bin/env bash
# The GPU-free core of the suite on the newest releases our ranges admit (the CuTe DSL,
# TVM-FFI, optuna, PyYAML; torch stays 2.13.0's CPU build, the only CPU torch here):
# vLLM and SGLang pin the DSL (4.8.0) and TVM-FFI (0.1.11) in the engines' venvs, so
# without this no CI run would compile the kernel with the DSL's newest release.
# A throwaway venv (DEST, default a temporary folder): prints the versions it got, then
# runs the PTX audit (every kernel variant cross-compiled for every architecture),
# the build, plan, config and table tests. Exit status: pytest's.
# Usage: scripts/check-newest.sh [DEST]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$(mktemp -d)}
[ -n "${1:-}" ] || trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
. "$venv/bin/activate"
"$root/scripts/install-torch-cpu.sh"
python -m pip install -q -e "$root[test]" 2> >(grep -v "^WARNING: Location '" >&2)
python - <<'PY'
from importlib.metadata import version
print("check-newest:", ", ".join(f"{p} {version(p)}" for p in (
    "nvidia-cutlass-dsl", "apache-tvm-ffi", "optuna", "PyYAML", "torch")))
PY
cd "$root"
python -m pytest -q -p no:cacheprovider tests/test_kernels_ptx.py tests/test_build.py \
    tests/test_plan.py tests/test_config.py tests/test_table.py
