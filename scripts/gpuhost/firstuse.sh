# GPU-host pass (issue 12 item 2, "Done when"): first-use tuning at install with N
# processes on the one GPU (gloo + IPC mailbox). A vLLM-shaped model, no table entry
# for this GPU (a fresh user table under $OUT, LAMPORT_HEAD_TABLE unset): start 1
# measures, writes the user table (emulated: true: time-sliced processes are not
# performance) and, with LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED=1 (this test only),
# serves the rows that won, checked bitwise; start 2 reads the entry and measures
# nothing. Prints each start's log lines, the table and the seconds install took.
set -o pipefail
source /var/tmp/lamport-gpuhost/env.sh
source scripts/gpuhost/setup.sh
export LAMPORT_HEAD_CACHE=$OUT/firstuse-cache LAMPORT_HEAD_AUTOTUNE=1 LAMPORT_HEAD_AUTOTUNE_SERVE_EMULATED=1
unset LAMPORT_HEAD_TABLE
rm -rf "$LAMPORT_HEAD_CACHE"
run="timeout 300 torchrun --standalone --nproc-per-node ${N:-2} -m lamport_head.benches.diagnostics.ranks --autotune --rows ${CAP:-64} --calls 200"
echo "== start 1 (no entry: measures)"
$run --expect-measure yes 2>&1 | grep -v Warn | tee $OUT/firstuse-1.log | tail -40
echo "== start 2 (reads the entry: measures nothing)"
$run --expect-measure no 2>&1 | grep -v Warn | tee $OUT/firstuse-2.log | tail -40
