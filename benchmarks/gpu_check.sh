#!/usr/bin/env bash
# One pass on a GPU machine: the GPU tests, step costs against the HBM floor, engine throughput.
# Usage: benchmarks/gpu_check.sh OUTDIR
set -u
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m tlt_rt.models.default > "$out/model.log" 2>&1
python -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_kernel_accept.py \
    tests/test_kernel_attention.py tests/test_kernel_commit.py tests/test_ir_tree.py > "$out/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -8
timeout 170 python benchmarks/step_costs.py --model qwen2.5-7b --batch 1 16 64 --ctx 1024 8192 --verify 16 48 \
    --iters 10 --out "$out/steps.jsonl" > "$out/steps.log" 2>&1
tail -20 "$out/steps.log"
timeout 220 python benchmarks/engine_throughput.py --batch 1 16 --max-new-tokens 96 --strategies 8_4_16 \
    --out "$out/engine.jsonl" > "$out/engine.log" 2>&1
tail -12 "$out/engine.log"
