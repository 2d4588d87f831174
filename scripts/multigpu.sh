#!/usr/bin/env bash
# The real-rank run: validate against the stock all-gather and tune the real tables on
# 2, 4, 8 ranks. With as many GPUs as ranks: one GPU per rank, NCCL, symmetric memory.
# With fewer (one GPU): the same checks with N processes sharing it (gloo, CUDA IPC;
# correctness only, and the tuned sections are written emulated: true).
# NVLink multicast stays off in every process. Every step must pass (set -e).
#   scripts/multigpu.sh [N...]        default: 2 4 8
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$gpus" -ge 1 ] || { echo "multigpu.sh: needs a CUDA GPU, found none" >&2; exit 2; }
sizes=("$@"); [ ${#sizes[@]} -gt 0 ] || sizes=(2 4 8)
rows=1,2,3,4,6,8,12,16,24,32,48,64
calls=10000; [ "$gpus" -ge 2 ] || calls=300  # shared GPU: ~20-100 ms per call
mkdir -p results
for n in "${sizes[@]}"; do
  run="torchrun --standalone --nproc-per-node $n"
  $run -m lamport_head.tuning.diagnostics.ranks --calls "$calls"
  $run -m lamport_head.tuning.diagnostics.ranks --calls 1000 --kill-rank 1 --kill-after 100
  $run -m lamport_head.tuning.diagnostics.ranks --calls 40 --slow-rank 1 --slow-s 3 --budget 1 --late-push
  $run -m lamport_head.tuning.diagnostics.ranks --install
  for dcp in 1 "$n"; do
    $run -m lamport_head.cli tune --tp "$n" --dcp "$dcp" --rows "$rows" \
      --out tables/head_gather.yaml --plot "results/tune-tp$n-dcp$dcp.png" --quiet
  done
  $run -m lamport_head.cli bench --tp "$n" --rows "$rows" --out "results/bench-tp$n" \
    --plot "results/bench-tp$n.png"
done
