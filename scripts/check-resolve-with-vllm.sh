#!/usr/bin/env bash
# pip's resolver says lamport-head and vllm==0.33.0 install together, vLLM's own
# torch==2.14.0 pinned. Nothing is installed (--dry-run): a throwaway venv with a
# current pip resolves from PyPI metadata and prints what it would install of the
# packages both name.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q -U pip
"$venv/bin/python" -m pip install -q --dry-run --ignore-installed --report "$venv/report.json" \
    "lamport-head @ file://$root" vllm==0.33.0 torch==2.14.0
"$venv/bin/python" - "$venv/report.json" <<'PY'
import json
import sys

got = {i["metadata"]["name"].lower(): i["metadata"]["version"]
       for i in json.load(open(sys.argv[1]))["install"]}
shown = ("lamport-head", "vllm", "torch", "nvidia-cutlass-dsl", "apache-tvm-ffi")
missing = [n for n in shown if n not in got]
if missing:
    sys.exit(f"resolution lacks {missing}")
print("resolves together:", ", ".join(f"{n}=={got[n]}" for n in shown))
PY
