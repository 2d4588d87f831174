# One GPU-host session: bench, emulated tune, GPU tests. Logs under $OUT.
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
mkdir -p results
timeout 150 lamport-head bench --tp 8 --rows 1,2,4,8,16,32,64 --out $OUT/bench --plot $OUT/bench.png 2>&1 | tee $OUT/bench.log | grep -v Warn
timeout 300 lamport-head tune --emulate --tp 8 --rows 1,2,4,8,16,32,64 --trials ${TRIALS:-24} --quiet --out tables/head_gather.yaml --plot $OUT/tune.png 2>&1 | tee $OUT/tune.log | tail -14
cp tables/head_gather.yaml $OUT/ 2>/dev/null
timeout 200 python3 -m pytest -q tests/ -m gpu 2>&1 | tee $OUT/gpu-tests.log | tail -4
