#!/usr/bin/env bash
# Tree attention's split partials on one GPU: its GPU tests, the kernel with every split written and merged
# against the used splits only (bench_attention.py --tree-splits, Qwen2.5-Coder-1.5B's and Qwen2.5-7B's heads,
# an engine-wide and an RL config's block table), then what a speculative step costs in plain steps on the 1.5B
# shape (step_ratio.py: random bf16 weights, a random drafter with an 8,192-id head), by default and with the
# one-row chain.
#   benchmarks/gpu_tree_splits.sh OUT     (logs and records in OUT; TESTS=0 leaves the tests out, RATIO=0 the ratios)
set -u
out=${1:?OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_attention.py > "$out/attn_tests.log" 2>&1
  tail -2 "$out/attn_tests.log"
fi
for shape in qwen2.5-coder-1.5b qwen2.5-7b; do
  timeout 150 python benchmarks/bench_attention.py --tree-splits --shape "$shape" --table 32768 2624 \
      --cases ${CASES:-1x128x32 1x1024x32 1x1024x12 32x128x32 1x128x4} --rounds "${ROUNDS:-5}" \
      > "$out/tree-splits-$shape.log" 2>&1
  tail -14 "$out/tree-splits-$shape.log"
done
if [ "${RATIO:-1}" = 1 ]; then
  for engine in "" "decode_chain=true pdl=true"; do
    name=$(echo "${engine:-default}" | tr ' =' '_-')
    # shellcheck disable=SC2086  # the settings split into KEY=VALUE words
    timeout "${RATIO_SECONDS:-150}" python benchmarks/step_ratio.py --model qwen2.5-coder-1.5b --batch ${BATCHES:-1 32} \
        --strategies 8_4_32 6_2_12 --rounds 3 --draft-vocab 8192 ${engine:+--engine $engine} \
        --out "$out/ratio-$name.jsonl" > "$out/ratio-$name.log" 2>&1
    echo "step ratio, engine ${engine:-default}:"; tail -6 "$out/ratio-$name.log"
  done
fi
