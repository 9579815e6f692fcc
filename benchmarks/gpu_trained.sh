#!/usr/bin/env bash
# With a trained SmolLM2 drafter: engine tokens/s over batch 1-128 (SD off, fixed strategies, auto) against
# transformers' generate, then the report's strategy table (verify 16 / 32 / 64, projected to the Qwen2.5-7B
# shape and one Llama-3.3-70B TP=8 rank) and the long-tail adaptivity case.
# Usage: benchmarks/gpu_trained.sh OUTDIR DRAFTER_DIR
set -u
out=$1 drafter=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m tlt_rt.models.default > "$out/model.log" 2>&1
timeout "${ENGINE_SECS:-170}" python benchmarks/engine_throughput.py --batch 1 8 32 128 --max-new-tokens 128 \
    --strategies 8_4_32 6_2_12 --drafter "$drafter" --hf-prompts 2 --repeats 2 \
    --out "$out/engine.jsonl" > "$out/engine.log" 2>&1
echo "engine_throughput rc=$?"
grep -E "^\|" "$out/engine.log" | tail -n 16
timeout "${REPORT_SECS:-380}" python benchmarks/gpu_report.py --out "$out/report" --sections strategies,adaptivity \
    --models smollm2 qwen2.5-7b llama-70b-tp8-rank --drafter "$drafter"
echo "gpu_report rc=$?"
grep -E "^Policy choice|^\| (on|off|auto) " "$out/report/report.md"
