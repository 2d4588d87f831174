#!/usr/bin/env bash
# pip's resolver says lamport-head installs with vLLM VERSION (default 0.33.0; CI runs
# each release of the window: tests/helpers.py VLLM_RELEASES), vLLM's own pins of the
# packages both name held. Nothing is installed (--dry-run): a throwaway venv with a current
# pip resolves from the registry's metadata.
#
# 1. vLLM's pins of torch, the CuTe DSL (nvidia-cutlass-dsl) and TVM-FFI, read from the
#    wheel's METADATA (pip's report of vllm==VERSION without its dependencies).
# 2. lamport-head, vllm==VERSION and those pins together: resolved, it prints what it
#    would install of the shared packages; exit 0.
# 3. Else, if pip stopped because a requirement of vLLM's own is not on the registry
#    (vllm==0.34.0 pins flashinfer-python==0.7.3, which is not there: vLLM alone does not
#    resolve), that is vLLM's gap, said in one line; lamport-head must then resolve with
#    vLLM's pins without vLLM (shown as in 2), and the script exits 0. Anything else (our
#    requirements against vLLM's pins, a gap in our own tree) is ours: pip's error, exit 1.
set -euo pipefail
version=${1:-0.33.0}
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
py=$venv/bin/python
python3 -m venv "$venv"
# pip, its notes about configured local indexes that lack a package left out
pip_() { "$py" -m pip "$@" 2> >(grep -v "^WARNING: Location '" >&2); }
pip_ install -q -U pip
pip_ install -q --dry-run --no-deps --ignore-installed --report "$venv/vllm.json" \
    "vllm==$version"
pins=$("$py" - "$venv/vllm.json" <<'PY'
import json
import sys

from pip._vendor.packaging.requirements import Requirement

shared = ("torch", "nvidia-cutlass-dsl", "apache-tvm-ffi")
(meta,) = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]
found = {}
for line in meta.get("requires_dist", []):
    r = Requirement(line)
    if r.name.lower() in shared and r.marker is None:
        found[r.name.lower()] = str(r)
missing = [n for n in shared if n not in found]
if missing:
    sys.exit(f"check-resolve: vllm {meta['version']}'s METADATA pins none of {missing}")
print("\n".join(found[n] for n in shared))
PY
)  # an assignment, so that a METADATA without the pins stops the script (set -e)
mapfile -t pins <<<"$pins"
show() {  # the report's versions of the shared packages (and vLLM, when resolved with it)
    "$py" - "$1" "$2" <<'PY'
import json
import sys

got = {i["metadata"]["name"].lower(): i["metadata"]["version"]
       for i in json.load(open(sys.argv[1]))["install"]}
shown = ["lamport-head"] + (["vllm"] if "vllm" in got else []) + [
    "torch", "nvidia-cutlass-dsl", "apache-tvm-ffi"]
missing = [n for n in shown if n not in got]
if missing:
    sys.exit(f"check-resolve: resolution lacks {missing}")
print(sys.argv[2], ", ".join(f"{n}=={got[n]}" for n in shown))
PY
}
if "$py" -m pip install -q --dry-run --ignore-installed --report "$venv/all.json" \
        "lamport-head @ file://$root" "vllm==$version" "${pins[@]}" 2>"$venv/err"; then
    show "$venv/all.json" "resolves together:"
    exit 0
fi
# vLLM's own gap: pip could not find a requirement vLLM's METADATA states exactly
gap=$("$py" - "$venv/err" "$venv/vllm.json" <<'PY'
import json
import re
import sys

from pip._vendor.packaging.requirements import Requirement

err = open(sys.argv[1]).read()
(meta,) = [i["metadata"] for i in json.load(open(sys.argv[2]))["install"]]
theirs = {str(Requirement(line)).lower() for line in meta.get("requires_dist", [])}
# pip names who asked: "(from vllm)" (or "(from vllm==X)")
found = re.search(r"^ERROR: No matching distribution found for (\S+) \(from vllm[=\d.]*\)$",
                  err, re.M)
asked = re.search(r"^ERROR: Could not find a version that satisfies the requirement (\S+) "
                  r"\(from vllm[=\d.]*\)", err, re.M)
if found and asked and found.group(1) == asked.group(1) and found.group(1).lower() in theirs:
    print(found.group(1))
PY
)
if [ -z "$gap" ]; then
    grep -v "^WARNING: Location '" "$venv/err" >&2
    echo "check-resolve: lamport-head does not resolve with vllm==$version (above)" >&2
    exit 1
fi
echo "check-resolve: vllm==$version does not resolve from the registry: its own requirement" \
     "$gap is not there (vLLM's gap, not lamport-head's)"
if ! "$py" -m pip install -q --dry-run --ignore-installed --report "$venv/ours.json" \
        "lamport-head @ file://$root" "${pins[@]}" 2>"$venv/err"; then
    grep -v "^WARNING: Location '" "$venv/err" >&2
    echo "check-resolve: lamport-head does not resolve with vllm==$version's pins" \
         "${pins[*]} (above)" >&2
    exit 1
fi
show "$venv/ours.json" "resolves with vllm==$version's pins:"
