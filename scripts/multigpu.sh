#!/usr/bin/env bash
# The multi-GPU run (issue: validate against NCCL and tune the real tables on 2, 4, 8
# GPUs). Needs N >= 2 GPUs on one host; NVLink multicast stays off in every process.
#   scripts/multigpu.sh [N...]        default: every power of two up to the GPU count
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
sizes=("$@"); if [ ${#sizes[@]} -eq 0 ]; then for n in 2 4 8; do [ "$n" -le "$gpus" ] && sizes+=("$n"); done; fi
[ ${#sizes[@]} -gt 0 ] || { echo "multigpu.sh: needs at least 2 GPUs, found $gpus" >&2; exit 2; }
rows=1,2,3,4,6,8,12,16,24,32,48,64
mkdir -p results
for n in "${sizes[@]}"; do
  torchrun --nproc-per-node "$n" -m lamport_head.tuning.ranks --calls 10000
  torchrun --nproc-per-node "$n" -m lamport_head.tuning.ranks --calls 1000 --kill-rank 1 --kill-after 300 || true
  for dcp in 1 "$n"; do
    torchrun --nproc-per-node "$n" -m lamport_head.cli tune --tp "$n" --dcp "$dcp" --rows "$rows" \
      --out tables/head_gather.yaml --plot "results/tune-tp$n-dcp$dcp.png" --quiet
  done
  torchrun --nproc-per-node "$n" -m lamport_head.cli bench --rows "$rows" --out "results/bench-tp$n" \
    --plot "results/bench-tp$n.png"
done
