#!/usr/bin/env bash
# GPU pass for the drafter: every `gpu` test, then a SmolLM2 drafter warmed up on the target's own answers
# sampled at the RL temperature, with accept length (8_4_48) before and after, sampled and greedy, on
# held-out prompts. Usage: benchmarks/gpu_drafter.sh OUTDIR [DRAFTER_DIR]
#   PROMPTS (1024) x SAMPLES (4) training answers, EPOCHS (5) passes; TEST_SECS=0 skips the tests.
set -u
out=${1:-gpu-results}
drafter=${2:-$out/drafter}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m tlt_rt.models.default > "$out/model.log" 2>&1
if [ "${TEST_SECS:-150}" -gt 0 ]; then
  timeout "${TEST_SECS:-150}" python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
  echo "gpu tests (rc=$?): $(tail -1 "$out/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -8
fi
timeout "${WARMUP_SECS:-300}" python -m tlt_rt.train.drafter.warmup --out "$drafter" --prompts "${PROMPTS:-1024}" \
    --samples "${SAMPLES:-4}" --held-out 64 --max-new-tokens 256 --temperature 1.0 --eval-temperatures 0 \
    --strategy 8_4_48 --epochs "${EPOCHS:-5}" > "$out/warmup.log" 2>&1
echo "warm-up rc=$?"
cp "$drafter/warmup.json" "$out/" 2>/dev/null
grep -v "drafter warm-up" "$out/warmup.log" | tail -n 5
