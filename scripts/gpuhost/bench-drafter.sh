# GPU-host pass (issue 32 item 6): `lamport-head bench --drafter` on one GPU, emulated TP 8
# then TP 2 (per M requests: the target's verification gather, an EAGLE3 draft head's
# 32000-wide gather and the candidate gather of vLLM's get_top_tokens, 8 BF16 a rank,
# each against the HBM floor and a torch op; the per-step totals for k = 3 draft
# tokens), then the torchrun path with 2 processes sharing the GPU (that path's
# correctness only: time-sliced, not performance).
#
# Run from the repository root:
#   source /var/tmp/lamport-gpuhost/env.sh; source scripts/gpuhost/setup.sh; bash scripts/gpuhost/bench-drafter.sh
# (it sources both itself when this tree's package is not the one installed).
# Writes under $OUT: bench-drafter-tp8.{csv,json,log}, bench-drafter-tp2.*,
# bench-drafter-torchrun2.*. Each run has its own timeout (T seconds, default 120).
set -o pipefail
OUT=${OUT:-results}
T=${T:-120}
mkdir -p "$OUT"
installed=$(python3 -c "import importlib.util as u, lamport_head, os; assert u.find_spec('lamport_head.benches.draftbench'); print(os.path.dirname(os.path.dirname(lamport_head.__file__)))" 2>/dev/null)
if [ "$installed" != "$PWD" ]; then
  source /var/tmp/lamport-gpuhost/env.sh
  source scripts/gpuhost/setup.sh
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
for tp in 8 2; do
  timeout -k 15 "$T" lamport-head bench --drafter --tp "$tp" --rows 1,2,4,8,16,32,64 \
    --out "$OUT/bench-drafter-tp$tp" > "$OUT/bench-drafter-tp$tp.log" 2>&1
  echo "bench --drafter tp $tp: rc $?"
done
timeout -k 15 "$T" torchrun --standalone --nproc-per-node 2 -m lamport_head.cli bench --drafter \
  --tp 2 --rows 1,8 --out "$OUT/bench-drafter-torchrun2" > "$OUT/bench-drafter-torchrun2.log" 2>&1
echo "bench --drafter torchrun 2: rc $?"
tail -n 20 "$OUT"/bench-drafter-*.log
