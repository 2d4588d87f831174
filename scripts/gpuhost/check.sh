# GPU-host pass for the fail-stop and processes-on-one-GPU work. Logs under $OUT.
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
python3 -c "import cutlass, tvm_ffi, torch; print('torch', torch.__version__, 'tvm_ffi', tvm_ffi.__version__)" 2>&1 | tail -1
timeout ${GPU_T:-280} python3 -m pytest -q -x tests/test_gpu_gather.py -s -p no:cacheprovider 2>&1 | tee $OUT/gpu.log | grep -v Warn | tail -${TAILN:-25}
