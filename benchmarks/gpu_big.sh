#!/usr/bin/env bash
# Large shapes with random bf16 weights on one GPU: decode / verify step time against the HBM floor for the
# Qwen2.5-32B shape and one rank of Llama-3.3-70B at TP=8 (its per-GPU compute and traffic, no all-reduce),
# and the CUDA-graph pool of an engine on that rank shape. Usage: benchmarks/gpu_big.sh OUTDIR
set -u
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout "${ROOF_SECS:-240}" python benchmarks/gpu_report.py --out "$out/roofline" --sections roofline \
    --models qwen2.5-32b llama-70b-tp8-rank --batches 1 4 16 64 --contexts 1024 4096 16384
echo "roofline rc=$?"
grep -E "^\| (qwen|llama)" "$out/roofline/report.md" | awk -F'|' '$4 ~ / (1|64) $/' | head -n 12
timeout "${MEM_SECS:-150}" python benchmarks/gpu_report.py --out "$out/memory" --sections memory \
    --models llama-70b-tp8-rank
echo "memory rc=$?"
grep -E "^\| llama" "$out/memory/report.md"
