# GPU-host pass: the processes-on-one-GPU tests. Logs under $OUT.
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
timeout ${MP_T:-540} python3 -m pytest -q -m multiproc tests/test_multiproc.py -s -p no:cacheprovider ${MP_K:+-k "$MP_K"} 2>&1 | tee $OUT/multiproc.log | grep -v Warn | tail -${TAILN:-40}
