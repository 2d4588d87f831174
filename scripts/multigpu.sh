#!/usr/bin/env bash
# What only several GPUs can show, in one command (issue 28 item 6), for 2, 4 and 8 ranks
# with one GPU each (fewer GPUs than ranks: the same checks as N processes sharing one
# GPU, gloo + the cuMem IPC mailbox; correctness only, sections written emulated: true):
#   - bitwise against NCCL's all-gather, free-running ranks, fresh planted data;
#   - each process holds a CUDA context on its own GPU only (nvidia-smi);
#   - one GPU visible per process (CUDA_VISIBLE_DEVICES per rank, as Ray/SLURM/K8s):
#     install serves, bitwise;
#   - a killed rank (every survivor names it), a slow rank, a late push;
#   - a killed rank with a canary on its GPU (no survivor store lands in the canary);
#   - install across processes; first-use tuning at install (a fresh cache);
#   - the tune (dcp 1 and n) and the bench against NCCL's path;
#   - the all-to-all of vocab shards: bitwise, tuned, benched against NCCL's all-to-all.
# The globaltimer-based diagnostics (benches/diagnostics/phases.py: virtual ranks' clocks
# compared on one GPU) are one-GPU only and do not run here.
# Every step runs whatever the previous did; a summary table ends the run (exit 1 if
# any step failed). NVLink multicast stays off in every process.
#   scripts/multigpu.sh [N...]        default: 2 4 8; logs under results/multigpu/
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$gpus" -ge 1 ] || { echo "multigpu.sh: needs a CUDA GPU, found none" >&2; exit 2; }
sizes=("$@"); [ ${#sizes[@]} -gt 0 ] || sizes=(2 4 8)
rows=1,2,3,4,6,8,12,16,24,32,48,64
calls=10000; [ "$gpus" -ge 2 ] || calls=300  # shared GPU: ~20-100 ms per call
logs=results/multigpu; mkdir -p "$logs"
summary=()

step() {  # step NAME COMMAND...: run it, log it, record the outcome and the time
  local name=$1; shift
  local log="$logs/$(echo "$name" | tr ' /=' '___').log" t0=$SECONDS
  echo "== $name: $*" >&2
  "$@" >"$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-44s %-5s %5ss  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
               $((SECONDS - t0)) "$(grep -E '^ranks |passed|failed|^  canary' "$log" | tail -1 | cut -c1-90)")")
}

for n in "${sizes[@]}"; do
  run=(torchrun --standalone --nproc-per-node "$n")
  ranks=("${run[@]}" -m lamport_head.benches.diagnostics.ranks)
  step "tp$n bitwise vs NCCL" "${ranks[@]}" --calls "$calls"
  step "tp$n kill" "${ranks[@]}" --calls 1000 --kill-rank 1 --kill-after 100
  step "tp$n slow + late push" "${ranks[@]}" --calls 40 --slow-rank 1 --slow-s 3 --budget 1 --late-push
  step "tp$n install" "${ranks[@]}" --install
  if [ "$gpus" -ge "$n" ]; then
    step "tp$n contexts (own GPU only)" "${ranks[@]}" --install --contexts
    step "tp$n one GPU visible per process" "${run[@]}" --no-python bash -c \
      'CUDA_VISIBLE_DEVICES=$LOCAL_RANK exec python3 -m lamport_head.benches.diagnostics.ranks --install'
  fi
  cache=$(mktemp -d)
  step "tp$n first-use tuning" env LAMPORT_HEAD_CACHE="$cache" "${ranks[@]}" --autotune --expect-measure yes
  step "tp$n first-use, second start" env LAMPORT_HEAD_CACHE="$cache" "${ranks[@]}" --autotune --expect-measure no
  for dcp in 1 "$n"; do
    step "tp$n tune dcp=$dcp" "${run[@]}" -m lamport_head.cli tune --tp "$n" --dcp "$dcp" \
      --rows "$rows" --out tables/head_gather.yaml --plot "$logs/tune-tp$n-dcp$dcp.png" --quiet
  done
  step "tp$n bench vs NCCL" "${run[@]}" -m lamport_head.cli bench --tp "$n" --rows "$rows" \
    --out "$logs/bench-tp$n" --plot "$logs/bench-tp$n.png"
  # the all-to-all of vocab shards (vLLM 0.34's batch-sharded sampling)
  step "tp$n all-to-all bitwise" "${ranks[@]}" --all-to-all --calls "$calls"
  step "tp$n tune --all-to-all" "${run[@]}" -m lamport_head.cli tune --all-to-all --tp "$n" \
    --rows "$rows" --out tables/head_gather.yaml --quiet
  step "tp$n bench --all-to-all vs NCCL" "${run[@]}" -m lamport_head.cli bench --all-to-all \
    --tp "$n" --splits uneven --rows "$rows" --out "$logs/bench-a2a-tp$n"
done
if [ "$gpus" -ge 2 ]; then  # the multi-GPU tests: kill with a canary, contexts, visibility
  step "pytest -m multigpu" python3 -m pytest -q -s -m multigpu tests/test_multigpu.py
fi

echo
printf '%-44s %-5s %6s  %s\n' step "" time "last line"
failed=0
for line in "${summary[@]}"; do
  echo "$line"
  case "$line" in *" FAIL "*) failed=1 ;; esac
done
exit $failed
