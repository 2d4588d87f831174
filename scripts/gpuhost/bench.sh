# GPU-host pass: the emulated TP-8 bench (eager vs captured), then the GPU soak's
# short form. Logs and the bench files under $OUT.
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
timeout ${BENCH_T:-200} lamport-head bench --tp 8 --rows ${ROWS:-1,2,4,8,16,32,64} --out $OUT/bench --plot $OUT/bench.png 2>&1 | grep -v Warn | tee $OUT/bench.log | tail -22
