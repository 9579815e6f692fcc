#!/usr/bin/env bash
# One pass on a GPU machine: every `gpu` test, engine throughput over a batch sweep (SD off / fixed strategies /
# auto, fresh or given drafter), and a short RL comparison (SD off vs auto + spot training).
# Usage: benchmarks/gpu_check.sh OUTDIR [DRAFTER_DIR]     (RL_STEPS=N sets the RL run length, 0 skips it)
set -u
out=${1:-gpu-results}
drafter=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m tlt_rt.models.default > "$out/model.log" 2>&1
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -8
timeout 200 python benchmarks/engine_throughput.py --batch 1 8 32 128 --max-new-tokens 128 \
    --strategies 8_4_16 6_2_12 ${drafter:+--drafter "$drafter"} --hf-prompts 0 \
    --out "$out/engine.jsonl" > "$out/engine.log" 2>&1
tail -22 "$out/engine.log"
if [ "${RL_STEPS:-3}" -gt 0 ]; then
  timeout 140 bash benchmarks/gpu_rl.sh "$out/rl" "${RL_STEPS:-3}" ${drafter:+drafter.path="$drafter"} \
      > "$out/rl.log" 2>&1
  tail -20 "$out/rl.log"
fi
