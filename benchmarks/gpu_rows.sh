#!/usr/bin/env bash
# A decode step's 9-64 rows (a batch of 32, a speculative step's verify rows) through the chain of Triton kernels,
# on one GPU: Qwen2.5-Coder-1.5B's and 0.5B's shapes (random bf16 weights, graphs, block tables as wide as the RL
# configs' engines), step_costs.py's variants side by side in interleaved rounds: the one-row chain whose larger
# steps take cuBLAS (pdl), the chain of up to 64 rows with skinny_gemm's tensor-core tiles (pdl-rows) and with
# kernels.rows_gemm (pdl-rows2, and its launch settings), each variant's kernels profiled at batch 32.
# ATTN=1 then times decode attention's launch at batch 32, 128 and 1 on both shapes (at batch 32 attention was the
# step's largest item, 18 us a layer on the 1.5B): by default how many of its programs fit an SM, set by the merge
# step's tile (mt: 4,096 fp32 elements instead of 16,384) and a cap on registers a thread (r): compiled for sm_90
# its programs hold 218 registers, two of 4 warps an SM (168 with the smaller merge tile: three; 128: four, with
# 80 bytes of spills); and the split merge over the group's rows only (tm=1: more splits a merge step; 1.03x on the
# 0.5B's batch-1 step when first timed). Its split count (sw=4 / 8) and stages (s=3 / 4) were timed: lost or tied.
#   benchmarks/gpu_rows.sh OUT [GPU]     (logs and records in OUT; GPU: CUDA_VISIBLE_DEVICES, 0 by default)
# TREE=1 then times tree attention's launch on the verify rows (batch 1, 16 and 48 tokens) on both shapes: its
# combine's tile (mt: 4,096 instead of 16,384; sm_90: 168 registers against 255 with spills) and 64-row blocks (bm).
# Settings: VARIANTS15 / VARIANTS05 (step_costs.py --compare names per model, the first the baseline; "" leaves that
# model out), ROUNDS (5), STEP_SECONDS (260 / 200), ATTN (0), ATTN_VARIANTS (pdl pdl:attn:tm=1
# pdl:attn:tm=1,mt=4096 pdl:attn:mt=4096,r=128 pdl:attn:sw=4,mt=4096,r=128: 218 / 207 / 168 / 128 registers),
# ATTN_BATCHES (32 128 1), ATTN_MODELS (both shapes), TREE (0), TREE_VARIANTS (pdl pdl:tree:mt=4096 pdl:tree:bm=64
# pdl:tree:bm=64,mt=4096).
set -u
out=${1:?OUT}; gpu=${2:-0}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
v15=${VARIANTS15-pdl pdl-rows2 pdl-rows2:split:t=4 pdl-rows2:split:t=8 pdl-rows2:split:p=132}
v05=${VARIANTS05-pdl pdl-rows2 pdl-rows2:split:t=4}
for model in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do
  if [ "$model" = qwen2.5-coder-1.5b ]; then variants=$v15; limit=${STEP_SECONDS:-260}; else variants=$v05; limit=${STEP_SECONDS:-200}; fi
  [ -n "$variants" ] || continue
  # shellcheck disable=SC2086  # the variant list splits on purpose
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python benchmarks/step_costs.py --model "$model" --batch 32 1 --ctx 1024 \
      --table 2624 --verify 16 48 --compare $variants --skinny-min-weight 0 --rounds "${ROUNDS:-5}" --profile \
      --out "$out/rows-$model.jsonl" > "$out/rows-$model.log" 2>&1
  echo "== $model"; grep -A30 "variants side by side" "$out/rows-$model.log" | grep -E "^(variant|pdl)" \
      || tail -20 "$out/rows-$model.log"
done
# sweep NAME TITLE "BATCHES" "VERIFY" "VARIANTS": step_costs.py's variants side by side on each ATTN_MODELS shape, into
# OUT/NAME-MODEL.{log,jsonl}, the table's rows echoed
sweep() {
  local name=$1 title=$2 batches=$3 verify=$4 variants=$5 model
  for model in ${ATTN_MODELS:-qwen2.5-coder-1.5b qwen2.5-coder-0.5b}; do
    # shellcheck disable=SC2086  # the batch, verify and variant lists split on purpose
    CUDA_VISIBLE_DEVICES=$gpu timeout "${STEP_SECONDS:-200}" python benchmarks/step_costs.py --model "$model" \
        --batch $batches --ctx 1024 --table 2624 --verify $verify --compare $variants --skinny-min-weight 0 \
        --rounds "${ROUNDS:-5}" --out "$out/$name-$model.jsonl" > "$out/$name-$model.log" 2>&1
    echo "== $title, $model"; grep -A60 "variants side by side" "$out/$name-$model.log" | grep -E "^(variant|pdl)" \
        || tail -20 "$out/$name-$model.log"
  done
}
if [ "${ATTN:-0}" = 1 ]; then
  sweep attn attention "${ATTN_BATCHES:-32 128 1}" "" \
      "${ATTN_VARIANTS:-pdl pdl:attn:tm=1 pdl:attn:tm=1,mt=4096 pdl:attn:mt=4096,r=128 pdl:attn:sw=4,mt=4096,r=128}"
fi
if [ "${TREE:-0}" = 1 ]; then
  sweep tree "tree attention" 1 "16 48" "${TREE_VARIANTS:-pdl pdl:tree:mt=4096 pdl:tree:bm=64 pdl:tree:bm=64,mt=4096}"
fi
