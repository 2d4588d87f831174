# GPU-host pass after fixes: the re-run tests, the CLI under torchrun on one GPU, and
# the emulated TP-8 bench (eager vs captured). Logs under $OUT.
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_gather.py::test_fallbacks_take_stock_bitwise tests/test_gpu_graph.py tests/test_multiproc.py -k "fallbacks or graph or install or mailbox" 2>&1 | grep -v Warn | tee $OUT/retest.log | grep -E "^ranks|passed|failed|FAILED|Error" | tail -12
N=2 bash scripts/gpuhost/torchrun-one-gpu.sh
ROWS=1,8,64 BENCH_T=120 bash scripts/gpuhost/bench.sh
