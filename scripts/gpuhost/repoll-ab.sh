# One-off on the GPU host (fifth session): the smemfix branch's GPU files, then an A/B
# of the staged re-poll (this tree: volatile re-polls, ``repoll_staged``; build/abold:
# the same tree before that commit, cp.async re-polls, carried), the register-vs-staged
# threshold at TP 2, and where the visible cost goes behind the lm_head.
# Run after `source .gpuhost/b/install.sh` or env.sh. Logs under $OUT.
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
G="python3 -m lamport_head.tuning.diagnostics.grid --steps 20 --reps 5 --top 3"
t0=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gather.py tests/test_gpu_mailbox.py tests/test_gpu_graph.py 2>&1 | tee $OUT/gpu.log | grep -E "passed|failed|FAILED|Error" | tail -8
echo "== gpu files $((SECONDS - t0)) s"
ab() {  # tag: the staged rows' grid of this install
  timeout 70 $G --tp 8 --rows 16,64 --threads 256 --unroll 8 --staged 1 2>&1 | tee $OUT/tp8-$1.log | grep -v "^  no figure" | grep -v -i warn
  timeout 50 $G --tp 2 --rows 64 --threads 256 --unroll 8 --staged 1 2>&1 | tee $OUT/tp2-$1.log | grep -v "^  no figure" | grep -v -i warn
}
ab new
echo "== new $((SECONDS - t0)) s"
(cd build/abold && python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -2)
ab old
echo "== old $((SECONDS - t0)) s"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -2
ab new2
echo "== new2 $((SECONDS - t0)) s"
timeout 70 $G --tp 2 --rows 16,32 --threads 256 --unroll 4,8 2>&1 | tee $OUT/tp2-threshold.log | grep -v "^  no figure" | grep -v -i warn
echo "== threshold $((SECONDS - t0)) s"
timeout 60 python3 -m lamport_head.tuning.diagnostics.phases --lmhead --tp 8 --rows 1,8,16 --calls 100 2>&1 | grep -v -i warn | tee $OUT/phases-lmhead-tp8.log
timeout 40 python3 -m lamport_head.tuning.diagnostics.phases --lmhead --tp 2 --rows 1,8,16 --calls 100 2>&1 | grep -v -i warn | tee $OUT/phases-lmhead-tp2.log
echo "== phases $((SECONDS - t0)) s"
