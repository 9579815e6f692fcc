#!/usr/bin/env bash
# The drafter pass on one 4-GPU machine (Qwen2.5-Coder-1.5B- and 0.5B-Instruct, T=1.0): how close the warm-up's
# drafter comes to the perfect-drafter ceiling, and whether auto beats plain decoding at every batch size.
#   phase 1  GPU 0:  the 1.5B warm-up on WARMUP_PROMPTS (2,048) prompts x 4 answers over WARMUP_EPOCHS (2) passes;
#            GPU 1:  the 1.5B warm-up on WARMUP_PROMPTS1 (3,072) prompts over WARMUP_EPOCHS1 (1.5) passes;
#            GPU 2:  the 0.5B warm-up (its own config's task) on WARMUP_PROMPTS05 (2,048) prompts over 2 passes;
#            GPU 3:  every `gpu` test, then where a plain step's time goes with a drafter carried and without
#                    (engine_throughput.py --profile --kernels, batch 128, a fresh drafter: auto stays plain);
#            each warm-up generates its answers 512 at a time, cuts them at 512 tokens and measures every strategy
#            of the engine's default set at the end (warmup.json's accept_by_strategy);
#   phase 2  GPU 0:  the better 1.5B drafter: auto against off by batch size (1 / 8 / 32 / 128), interleaved;
#            GPU 1:  the same drafter at batch 32 and 128 with short chains beside the default strategies (fixed
#                    4_1_5, 3_1_4 and 8_4_8 against off, and auto choosing among all of them);
#            GPU 2:  the 0.5B drafter: auto against off by batch size, interleaved.
# Each job is its own process, pinned by CUDA_VISIBLE_DEVICES, with a quarter of the host's cores. Everything runs
# in the background; the call returns at once.
#
#   benchmarks/gpu_drafter_x4.sh OUT QWEN15_GGUF QWEN05_GGUF     start it (the logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_drafter_x4.sh --snapshot OUT DEST              progress lines, and the small records so far
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q15=${2:?QWEN15_GGUF}; q05=${3:?QWEN05_GGUF}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
share_cores 4
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml; cfg05=configs/qwen2.5-0.5b-math-gpu.yaml
p0=${WARMUP_PROMPTS:-2048}; e0=${WARMUP_EPOCHS:-2}; p1=${WARMUP_PROMPTS1:-3072}; e1=${WARMUP_EPOCHS1:-1.5}
p05=${WARMUP_PROMPTS05:-2048}

main() {
  local t0 best
  t0=$(date +%s)
  (
    CUDA_VISIBLE_DEVICES=3 timeout 480 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
    echo "tests done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
    CUDA_VISIBLE_DEVICES=3 timeout 300 python benchmarks/engine_throughput.py --target "$q15" --temperature 1 \
        --task-config "$cfg1" --configs off auto --strategies $DEFAULT --batch 128 --repeats 2 --max-new-tokens 256 --hf-prompts 0 \
        --profile 25 --kernels 12 --out "$out/carry.jsonl" > "$out/carry.log" 2>&1
  ) &
  (
    warm_up 2 "$cfg05" "$q05" "$p05" 2 "$out/w05"
    echo "0.5B warm-up done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
    # shellcheck disable=SC2086
    auto_off 2 "$q05" "$cfg05" "$out/w05/drafter" auto-off-q05 "1 8 32 128" --configs off auto --strategies $DEFAULT
  ) &
  convert_target
  local pa pb
  warm_up 0 "$cfg1" "$q15" "$p0" "$e0" "$out/w0" &
  pa=$!
  warm_up 1 "$cfg1" "$q15" "$p1" "$e1" "$out/w1" &
  pb=$!
  wait "$pa" "$pb"
  echo "1.5B warm-ups done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  VARIANTS=("$p0 x $e0" "$p1 x $e1")
  best=$(best_warmup)
  if [ "$best" -lt 0 ]; then echo "no 1.5B warm-up finished: see w*.log" >> "$out/choice.txt"; wait; return 1; fi
  echo "chosen: $out/w$best/drafter" >> "$out/choice.txt"
  # shellcheck disable=SC2086  # the strategy lists split on purpose
  auto_off 1 "$q15" "$cfg1" "$out/w$best/drafter" chains-q15 "32 128" --configs off auto 4_1_5 3_1_4 8_4_8 \
      --strategies $DEFAULT 4_1_5 3_1_4 &
  # shellcheck disable=SC2086
  auto_off 0 "$q15" "$cfg1" "$out/w$best/drafter" auto-off-q15 "1 8 32 128" --configs off auto --strategies $DEFAULT
  wait
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main best_warmup warmup_ratio convert_target warm_up auto_off); $(declare -p out q15 q05 cfg1 cfg05 p0 e0 p1 e1 p05 DEFAULT); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_drafter_x4.sh --snapshot $out DEST"
