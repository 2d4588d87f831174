# GPU-host pass (issue 21): `lamport-head bench` on one GPU, emulated TP 8 then TP 2
# (GPU time vs the HBM floor, default vs table plan, the lm_head GEMM and the
# gather's visible cost behind it with PDL on/off, host per call vs torch.add_,
# captured cost), then the real-rank code path under torchrun with 2 processes
# sharing the GPU (that path's correctness only: time-sliced, not performance).
# Then (issue 43 item 5) `lamport-head bench --all-to-all`: per M the all-to-all of
# vocab shards beside the all-gather of the same M, each against its HBM floor,
# emulated TP 8 (even, then uneven splits) and TP 2, and under torchrun with 2
# processes sharing the GPU (uneven splits; that path's correctness only).
#
# Run from the repository root:
#   source /var/tmp/lamport-gpuhost/env.sh; source scripts/gpuhost/setup.sh; bash scripts/gpuhost/bench.sh
# (it sources both itself when this tree's package is not the one installed).
# Writes under $OUT: env.log; bench-tp8.{csv,json,png,log}; bench-tp2.*;
# bench-torchrun2.{csv,json,log} (M = 1 only); a2a-tp8.log and a2a-tp8-all-to-all.{csv,json},
# a2a-tp8-uneven.*, a2a-tp2.*, a2a-torchrun2.* (M = 1, 8). About 4 minutes for the gather's
# runs, each all-to-all run at most A2A_T seconds: more than one device call holds
# (600 s), so split it: GATHER=0 PHASES=0 runs the all-to-all's alone, A2A=0 skips them.
# Each run has its own timeout (TP8_T, TP2_T, TR_T, A2A_T seconds); a run cut short
# (SIGTERM) still prints its tables for the rows it measured, and every CSV is rewritten
# after each row count. Prints each run's targets (the all-to-all's: its tables) and
# notes; the full tables are in the logs.
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
installed=$(python3 -c "import importlib.util as u, lamport_head, os; assert u.find_spec('lamport_head.benches.goals'); print(os.path.dirname(os.path.dirname(lamport_head.__file__)))" 2>/dev/null)
if [ "$installed" != "$PWD" ]; then
  source /var/tmp/lamport-gpuhost/env.sh
  source scripts/gpuhost/setup.sh
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv
  python3 -c "import torch, cutlass, tvm_ffi; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cutlass-dsl', cutlass.__version__, 'tvm_ffi', tvm_ffi.__version__)"
  git rev-parse --short HEAD 2>/dev/null
} > "$OUT/env.log" 2>&1
head -3 "$OUT/env.log"

run() {  # name seconds command...: log to $OUT/name.log, print its targets and notes
  local name=$1 seconds=$2
  shift 2
  local t0=$SECONDS
  timeout -k 15 "$seconds" "$@" --out "$OUT/$name" 2>&1 | grep -v -i warn > "$OUT/$name.log"
  local code=${PIPESTATUS[0]}
  echo "== $name: exit $code after $((SECONDS - t0)) s"
  sed -n '/^lamport-head bench/p;/^  mode/p;/^  lm_head shard/p;/^  per M/p;/interrupted/p;/^GPU time per step/,/^$/p;/^all-gather, \[M/,/^$/p;/^all-to-all, \[M/,$p;/^Targets/,$p;/Traceback/,$p' "$OUT/$name.log" | grep -v '^wrote' | head -60
}

ROWS=${ROWS:-1,2,4,8,16,32,64}
if [ "${GATHER:-1}" = 1 ]; then
  run bench-tp8 "${TP8_T:-100}" lamport-head bench --tp 8 --rows "$ROWS" --plot "$OUT/bench-tp8.png"
  run bench-tp2 "${TP2_T:-65}" lamport-head bench --tp 2 --rows "$ROWS" --plot "$OUT/bench-tp2.png"
  if [ "${TORCHRUN:-1}" = 1 ]; then
    run bench-torchrun2 "${TR_T:-40}" torchrun --standalone --nproc-per-node 2 -m lamport_head.cli bench --tp 2 --rows 1
  fi
fi
if [ "${A2A:-1}" = 1 ]; then
  run a2a-tp8 "${A2A_T:-120}" lamport-head bench --all-to-all --tp 8 --rows "$ROWS"
  run a2a-tp8-uneven "${A2A_T:-120}" lamport-head bench --all-to-all --tp 8 --splits uneven --rows "$ROWS"
  run a2a-tp2 "${A2A_T:-120}" lamport-head bench --all-to-all --tp 2 --rows "$ROWS"
  if [ "${TORCHRUN:-1}" = 1 ]; then
    run a2a-torchrun2 "${A2A_T:-120}" torchrun --standalone --nproc-per-node 2 -m lamport_head.cli bench --all-to-all --tp 2 --splits uneven --rows 1,8
  fi
fi
# Where the GPU time goes, phase by phase (the diagnostic kernel: benches/diagnostics/phases.py)
if [ "${PHASES:-1}" = 1 ]; then
  timeout "${PH_T:-60}" python3 -m lamport_head.benches.diagnostics.phases --tp 8 --rows 1,8,64 --calls 100 2>&1 | grep -v -i warn | tee "$OUT/phases.log" | tail -30
fi
