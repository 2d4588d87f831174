#!/usr/bin/env bash
# Real SGLang 0.5.23 for the tests against its classes (tests/test_sglang_real.py), in a
# venv of its own inside the active one ($VIRTUAL_ENV/sglang; LAMPORT_HEAD_SGLANG_VENV
# overrides): torch's CPU build (scripts/install-torch-cpu.sh), this project (editable)
# and pytest, the SGLang wheel without its dependencies, then only what the modules
# those tests import need (scripts/sglang-cpu-requirements.txt), torch held by a
# constraint so nothing pulls a CUDA build. The tests, run from the main venv, start
# their SGLang ranks under this venv's interpreter (tests/sglang_cpu.py).
# Run inside the main venv, after scripts/install-vllm-cpu.sh (or without it).
#
# Why its own venv: SGLang 0.5.23 pins compressed-tensors==0.18.0 and openai==2.8.0,
# and its modules import both at import time; vLLM 0.33.0 pins compressed-tensors==0.17.0
# and needs openai>=2.25.0 (also imported by the modules its tests load). No one venv
# meets both engines' specifiers.
#
# pip's resolver then complains that SGLang's other requirements (its CUDA torch 2.14.1,
# FlashInfer, sgl-kernel, ...) are missing: that is the point (a CPU test bed, ~60 lines
# of "sglang 0.5.23 requires X, which is not installed"). Those lines go to a log file
# and one line here says so; any other pip output, and every failure, is shown as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
main=$(python -c "import sys; print(sys.prefix)")
venv=${LAMPORT_HEAD_SGLANG_VENV:-$main/sglang}
log=${TMPDIR:-/tmp}/lamport-head-install-sglang-cpu.log
torch=$(python -W ignore -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null \
        || echo 2.13.0)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
[ -x "$venv/bin/python" ] || python -m venv "$venv"
PATH="$venv/bin:$PATH" "$here/install-torch-cpu.sh" "$torch"
echo "torch==$torch+cpu" >"$constraints"
pip() { "$venv/bin/python" -m pip "$@"; }
if ! pip install -q -c "$constraints" -e "$root" "pytest>=8" >"$log" 2>&1 \
   || ! pip install -q --no-deps sglang==0.5.23 >>"$log" 2>&1 \
   || ! pip install -q -c "$constraints" -r "$here/sglang-cpu-requirements.txt" >>"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
# Everything but the resolver's expected report (its header line and its
# "sglang 0.5.23 requires ..." lines) is shown.
grep -v -e "^ERROR: pip's dependency resolver does not currently take into account" \
        -e "^sglang 0\.5\.23 requires " -e "^WARNING: Location '" "$log" >&2 || true
left=$(grep -c "^sglang 0\.5\.23 requires " "$log" || true)
"$venv/bin/python" -c "from importlib.metadata import version; assert version('sglang') == '0.5.23'"
echo "install-sglang-cpu: sglang 0.5.23 installed for the CPU tests in $venv (its own venv:" \
     "its compressed-tensors and openai pins conflict with vLLM's); $left of its" \
     "requirements (CUDA torch, FlashInfer, sgl-kernel, ...) left out on purpose" \
     "(pip's list: $log)" >&2
