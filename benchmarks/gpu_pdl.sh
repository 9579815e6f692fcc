#!/usr/bin/env bash
# Programmatic dependent launch on one GPU: the PDL tests and the decode-chain kernels' GPU tests, then the decode
# step of Qwen2.5-Coder-1.5B's and 0.5B's shapes (random bf16 weights, graphs) side by side: the engine's default
# (base), the chain with PDL as it was at 86a0504 (pdl-before), with one row's products broadcast over three
# dimensions as at 925a864 (pdl-3d), and as it is (pdl). Equal logits hashes say the variants computed the same step.
#   benchmarks/gpu_pdl.sh OUT          (logs and records in OUT; TESTS=0 leaves the tests out)
# Settings: VARIANTS (step_costs.py --compare names, the first the baseline), BATCHES (1 8 32), ROUNDS (5), PROFILE
# (0; 1: each variant's kernels at the first batch), VERIFY (tree sizes of verify steps to time too, e.g. "16 48";
# none by default), TABLE (0: block tables as wide as the context; 2624: as an
# engine's of the Qwen RL configs, whose attention then splits the context into one-tile chunks), RATIO (0; 1: then
# what a speculative step costs in plain steps on the 1.5B shape, step_ratio.py, by default, with the one-row chain
# and with the chain of up to 64 rows).
set -u
out=${1:?OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl_gpu.py tests/test_kernel_skinny.py \
      tests/test_kernel_norm_linear.py tests/test_kernel_decode_rope.py tests/test_engine_gpu.py \
      > "$out/pdl_tests.log" 2>&1
  tail -3 "$out/pdl_tests.log"
fi
read -r -a variants <<< "${VARIANTS:-base pdl-before pdl-3d pdl}"
profile=(); [ "${PROFILE:-0}" = 1 ] && profile=(--profile)
for model in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do
  timeout "${STEP_SECONDS:-200}" python benchmarks/step_costs.py --model "$model" --batch ${BATCHES:-1 8 32} \
      --ctx 1024 --table "${TABLE:-0}" --verify ${VERIFY:-} --compare "${variants[@]}" --skinny-min-weight 0 \
      --rounds "${ROUNDS:-5}" "${profile[@]}" \
      --out "$out/pdl-$model.jsonl" > "$out/pdl-$model.log" 2>&1
  grep -A20 "variants side by side" "$out/pdl-$model.log" || tail -20 "$out/pdl-$model.log"
done
if [ "${RATIO:-0}" = 1 ]; then
  for engine in "" "decode_chain=true pdl=true" "decode_chain=true pdl=true decode_chain_rows=64"; do
    name=$(echo "${engine:-default}" | tr ' =' '_-')
    # shellcheck disable=SC2086  # the settings split into KEY=VALUE words
    timeout 200 python benchmarks/step_ratio.py --model qwen2.5-coder-1.5b --batch 1 --strategies 8_4_32 6_2_12 \
        --rounds 3 --draft-vocab 8192 ${engine:+--engine $engine} --out "$out/ratio-$name.jsonl" \
        > "$out/ratio-$name.log" 2>&1
    echo "step ratio, engine ${engine:-default}:"; tail -2 "$out/ratio-$name.log"
  done
fi
