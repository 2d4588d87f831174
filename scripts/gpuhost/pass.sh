# GPU-host pass for a release: the GPU files (co-residency included), then every
# processes-on-one-GPU test (engine-shaped fault cases, the canary, the peer killed in
# flight). Logs under $OUT. Run right after the second staging call
# (source .gpuhost/b/install.sh) or on a warm host (env.sh). About 9 minutes: the GPU
# files ~3 (co-residency 2.2 of them; the all-to-all file, 0.6.0, not yet run), multiproc ~6.5 (376 s measured in v0.3.5 with 19
# tests): GPU_T and MP_T are their limits; MP_K selects multiproc tests (pytest -k).
# v0.3.6 has 22 multiproc tests (the drafter's two engine-shaped cases and the peer killed
# in flight are new, not yet run): more than one device call holds (600 s). The
# all-to-all's 10 (issue 43 item 4: 4 free-running, 6 engine-shaped fault cases; not yet
# run) have calls of their own. Split it:
# The GPU files alone (SKIP_MP=1) fit one call with staging's second; then:
#   call 1: SKIP_GPU=1 MP_K='not (engine_shaped or killed_from_outside or dead_peers or all_to_all)' bash scripts/gpuhost/pass.sh
#   call 2: SKIP_GPU=1 MP_K='(engine_shaped or killed_from_outside or dead_peers) and not all_to_all' bash scripts/gpuhost/pass.sh
#   call 3: SKIP_GPU=1 MP_K='all_to_all and free_running' bash scripts/gpuhost/pass.sh
#   call 4: SKIP_GPU=1 MP_K='all_to_all and engine_shaped' bash scripts/gpuhost/pass.sh
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
OUT=${OUT:-results}
mkdir -p "$OUT"
if [ -z "$SKIP_GPU" ]; then
  timeout ${GPU_T:-360} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gather.py tests/test_gpu_mailbox.py tests/test_gpu_graph.py tests/test_gpu_coresidency.py tests/test_gpu_all_to_all.py 2>&1 | tee $OUT/gpu.log | grep -E "passed|failed|FAILED|Error" | tail -8
fi
[ -n "$SKIP_MP" ] && exit 0
timeout ${MP_T:-480} python3 -m pytest -q -s -p no:cacheprovider -m multiproc tests/test_multiproc.py ${MP_K:+-k "$MP_K"} 2>&1 | tee $OUT/multiproc.log | grep -E "^ranks|canary|kill n=|stall n=|killed-in-flight|passed|failed|FAILED|Error" | cut -c 1-420 | tail -40
