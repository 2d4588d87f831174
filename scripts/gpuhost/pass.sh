# GPU-host pass for a release: the GPU files, then every processes-on-one-GPU test
# (engine-shaped fault cases included). Logs under $OUT. Run right after the second
# staging call (source .gpuhost/b/install.sh) or on a warm host (env.sh).
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
OUT=${OUT:-results}
git rev-parse --short HEAD 2>/dev/null
timeout ${GPU_T:-90} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gather.py tests/test_gpu_mailbox.py tests/test_gpu_graph.py 2>&1 | tee $OUT/gpu.log | grep -E "passed|failed|FAILED|Error" | tail -8
timeout ${MP_T:-330} python3 -m pytest -q -s -p no:cacheprovider -m multiproc tests/test_multiproc.py 2>&1 | tee $OUT/multiproc.log | grep -E "^ranks|kill n=|stall n=|passed|failed|FAILED|Error" | cut -c 1-420 | tail -40
