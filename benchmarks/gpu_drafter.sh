#!/usr/bin/env bash
# GPU pass for the drafter: engine GPU tests, warm-up of a SmolLM2 drafter (accept length before/after),
# throughput with the trained drafter, decode/verify step costs. Usage: benchmarks/gpu_drafter.sh OUTDIR
set -u
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m tlt_rt.models.default > "$out/model.log" 2>&1
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py > "$out/gpu_tests.log" 2>&1
echo "engine gpu tests: $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)|Error" "$out/gpu_tests.log" | head -5
timeout 200 python -m tlt_rt.train.warmup --out "$out/drafter" --prompts 256 --samples 2 --steps 1500 \
    --max-new-tokens 192 --temperature 0.9 --strategy 8_4_48 > "$out/warmup.log" 2>&1
tail -2 "$out/warmup.log"
timeout 120 python benchmarks/engine_throughput.py --batch 1 16 --max-new-tokens 128 --strategies 8_4_48 6_2_12 \
    --drafter "$out/drafter" --hf-prompts 1 --out "$out/engine.jsonl" > "$out/engine.log" 2>&1
tail -10 "$out/engine.log"
timeout 60 python benchmarks/step_costs.py --model qwen2.5-7b --batch 1 64 --ctx 1024 --verify 48 --iters 10 \
    --out "$out/steps.jsonl" > "$out/steps.log" 2>&1
tail -6 "$out/steps.log"
