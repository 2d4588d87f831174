# The kernel A/B of issue 51 (benches/diagnostics/ab.py) on the GPU host: v0.3.4's
# kernel, v0.3.5's, 0.6.0's (c4c61df) with the launch flag 0 and 1, and this tree's
# with 0 and 1, emulated TP 2 and 8, M = 1, 2, 4, 16, two rounds in one run, then each
# variant's phases. The past trees travel as a carried folder, staged here first:
#   rm -rf .ab && for t in v034:0a45b23 v035:0cc13d0^ c4c61df:c4c61df; do
#     mkdir -p .ab/${t%%:*} && git archive ${t#*:} kernels | tar -x -C .ab/${t%%:*}; done
# then on the host (carry .ab): source env.sh; source setup.sh; bash scripts/gpuhost/ab.sh
# EXTRA adds variants ("--variant NAME=TREE[:FLAG] ..."). Writes $OUT/ab.log and $OUT/ab.json. About 4-5 minutes (AB_T limits it).
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout "${AB_T:-480}" python3 -m lamport_head.benches.diagnostics.ab --tp "${TPS:-2,8}" \
  --rows "${ROWS:-1,2,4,16}" --rounds "${ROUNDS:-2}" \
  --variant v0.3.4=.ab/v034 --variant v0.3.5=.ab/v035 \
  --variant c4c61df:0=.ab/c4c61df --variant c4c61df:1=.ab/c4c61df:1 \
  --variant head:0=. --variant head:1=.:1 $EXTRA ${PHASES:+--phases} --out "$OUT/ab.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/ab.log"
