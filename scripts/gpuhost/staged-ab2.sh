# One-off A/B (2): the rows between, register batches (unroll 4) against staged (4, 8).
set -o pipefail
OUT=${OUT:-results}
G="python3 -m lamport_head.tuning.diagnostics.grid --steps 20 --reps 5 --top 3"
for tp in 8 2; do
timeout 100 $G --tp $tp --rows 2,4,16,32 --threads 256 --unroll 4 --staged 0 2>&1 | tee $OUT/tp$tp-reg2.log | grep -v "^  no figure"
timeout 120 $G --tp $tp --rows 2,4,16,32 --threads 128,256 --unroll 4,8 --staged 1 2>&1 | tee $OUT/tp$tp-staged2.log | grep -v "^  no figure"
done
