# GPU-host pass: emulated GPU tests, mailbox tests, then the processes-on-one-GPU
# tests. Logs under $OUT.
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
python3 -c "import cutlass, tvm_ffi, torch; print('torch', torch.__version__, 'tvm_ffi', tvm_ffi.__version__)" 2>&1 | tail -1
timeout ${GPU_T:-200} python3 -m pytest -q tests/test_gpu_gather.py tests/test_gpu_mailbox.py tests/test_gpu_graph.py -s -p no:cacheprovider 2>&1 | tee $OUT/gpu.log | grep -v Warn | tail -${TAILN:-12}
timeout ${MP_T:-360} python3 -m pytest -q -m multiproc tests/test_multiproc.py -s -p no:cacheprovider ${MP_K:+-k "$MP_K"} 2>&1 | tee $OUT/multiproc.log | grep -v Warn | tail -${TAILN:-40}
