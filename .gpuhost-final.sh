# Final GPU-host pass: GPU tests after the host-path change, the diagnosis, the bench.
set -o pipefail
source .gpuhost-run.sh
timeout 120 python3 -m pytest -q tests/ -m gpu 2>&1 | tee $OUT/gpu-tests.log | tail -3
timeout 170 python3 -m lamport_head.tuning.diagnose 2>&1 | tee $OUT/diagnose.log | grep -v Warn
timeout 120 lamport-head bench --tp 8 --rows 1,8,64 --out $OUT/bench --plot $OUT/bench.png 2>&1 | tee $OUT/bench.log | grep -v Warn
