# GPU-host pass: the CLI under torchrun with N processes on the one GPU (verify,
# tune, bench): gloo + IPC mailbox, sections written emulated. Logs under $OUT.
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
run="timeout 200 torchrun --standalone --nproc-per-node ${N:-2}"
$run -m lamport_head.cli verify --tp ${N:-2} --calls 100 2>&1 | grep -v Warn | tee $OUT/verify.log | tail -3
$run -m lamport_head.cli tune --tp ${N:-2} --rows 1,8 --trials 3 --quiet --out $OUT/tune.yaml 2>&1 | grep -v Warn | tee $OUT/tune.log | tail -8
$run -m lamport_head.cli bench --tp ${N:-2} --rows 1,8 --table $OUT/tune.yaml --out $OUT/bench 2>&1 | grep -v Warn | tee $OUT/bench.log | tail -6
