#!/usr/bin/env bash
# The drafter at the RL temperature on one GPU: drafters warmed up on the RL workload's answers at T=1.0
# (SmolLM2 bf16), held-out accept length per strategy at T=1.0 and greedy beside the perfect-drafter
# ceiling of the same tree and verify budget on the same answers, and their ratio. One command. Measured on
# an H100 with 128 held-out prompts, one variant and one strategy: 7.5 minutes (90 s generating, 120 s
# training, each ceiling 55-90 s); the defaults here walk half as many answers and add a strategy.
# Usage: benchmarks/gpu_drafter_rl.sh OUTDIR          (a CPU check of the whole path: ... OUTDIR --tiny)
#   PROMPTS (1024) x SAMPLES (4) training answers; TRAIN_SECS (150) per variant (or its passes, whichever ends
#   first); VARIANTS (mix3e2, the warm-up's defaults; others: benchmarks/drafter_rl.py); STRATEGIES
#   (8_4_32,8_4_48); HELD_OUT (64) prompts; DRAFT_VOCAB (8192); extra arguments go to drafter_rl.py.
set -u
out=${1:-gpu-results}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m tlt_rt.models.default > "$out/model.log" 2>&1
timeout "${TOTAL_SECS:-900}" python benchmarks/drafter_rl.py --prompts "${PROMPTS:-1024}" --samples "${SAMPLES:-4}" \
    --train-seconds "${TRAIN_SECS:-150}" --variants "${VARIANTS:-mix3e2}" --held-out "${HELD_OUT:-64}" \
    --strategies "${STRATEGIES:-8_4_32,8_4_48}" --draft-vocab "${DRAFT_VOCAB:-8192}" --gen-batch 512 \
    --out "$out/drafter_rl.jsonl" "$@" > "$out/drafter_rl.log" 2> "$out/drafter_rl.err"
echo "drafter_rl rc=$?"
tail -n 20 "$out/drafter_rl.log"
grep -v "^\s*$" "$out/drafter_rl.err" | tail -n 8
