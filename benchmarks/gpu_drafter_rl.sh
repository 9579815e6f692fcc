#!/usr/bin/env bash
# The drafter at the RL temperature on one GPU: drafters warmed up on the RL workload's answers at T=1.0
# (SmolLM2 bf16), held-out accept length per strategy at T=1.0 and greedy beside the perfect-drafter
# ceiling of the same tree and verify budget, and their ratio. One command, about 8 minutes on an H100
# with the defaults below.
# Usage: benchmarks/gpu_drafter_rl.sh OUTDIR          (a CPU check of the whole path: ... OUTDIR --tiny)
#   PROMPTS (1024) x SAMPLES (4) training answers; TRAIN_SECS (90) per variant (or 5 epochs, whichever ends
#   first); VARIANTS (base,ttt3,vocab; also ttt3s, greedyT: benchmarks/drafter_rl.py); STRATEGIES (8_4_32,8_8_64);
#   DRAFT_VOCAB (8192) for the 'vocab' variant; extra arguments go to drafter_rl.py.
set -u
out=${1:-gpu-results}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m tlt_rt.models.default > "$out/model.log" 2>&1
timeout "${TOTAL_SECS:-900}" python benchmarks/drafter_rl.py --prompts "${PROMPTS:-1024}" --samples "${SAMPLES:-4}" \
    --train-seconds "${TRAIN_SECS:-90}" --variants "${VARIANTS:-base,ttt3,vocab}" \
    --strategies "${STRATEGIES:-8_4_32,8_8_64}" --draft-vocab "${DRAFT_VOCAB:-8192}" \
    --out "$out/drafter_rl.jsonl" "$@" > "$out/drafter_rl.log" 2> "$out/drafter_rl.err"
echo "drafter_rl rc=$?"
tail -n 20 "$out/drafter_rl.log"
grep -v "^\s*$" "$out/drafter_rl.err" | tail -n 8
