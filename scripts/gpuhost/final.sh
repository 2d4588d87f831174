# Final GPU-host pass: emulated tune, then the bench reading the new table.
set -o pipefail
source scripts/gpuhost/setup.sh
rm -f tables/head_gather.optuna.db
timeout 170 lamport-head tune --emulate --tp 8 --rows 1,2,4,8,16,32,64 --trials 10 --quiet --plot $OUT/tune.png 2>&1 | tee $OUT/tune.log | tail -11
cp tables/head_gather.yaml $OUT/
timeout 100 lamport-head bench --tp 8 --rows 1,2,4,8,16,32,64 --out $OUT/bench --plot $OUT/bench.png 2>&1 | tee $OUT/bench.log | grep -v Warn
