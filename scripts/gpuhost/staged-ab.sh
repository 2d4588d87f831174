# One-off A/B on the GPU host: register batches against shared-memory (staged) batches,
# through the grid diagnostic, then the GPU tests with staged as the default.
set -o pipefail
OUT=${OUT:-results}
G="python3 -m lamport_head.tuning.diagnostics.grid --steps 20 --reps 5 --top 4"
timeout 150 $G --tp 8 --rows 1,8,64 --threads 256 --unroll 4 --staged 0 2>&1 | tee $OUT/tp8-reg.log | grep -v "^  no figure" 
timeout 200 $G --tp 8 --rows 1,8,64 --threads 128,256,512 --unroll 4,8,16 --staged 1 2>&1 | tee $OUT/tp8-staged.log | grep -v "^  no figure"
timeout 60 $G --tp 2 --rows 1,8,64 --threads 256 --unroll 4 --staged 0 2>&1 | tee $OUT/tp2-reg.log | grep -v "^  no figure"
timeout 100 $G --tp 2 --rows 1,8,64 --threads 128,256,512 --unroll 4,8,16 --staged 1 2>&1 | tee $OUT/tp2-staged.log | grep -v "^  no figure"
