#!/usr/bin/env bash
# The drafter pass on one GPU (Qwen2.5-Coder-0.5B-Instruct, its own config's task, T=1.0):
#   phase 1  the warm-up on WARMUP_PROMPTS (5,120) prompts x 4 answers over WARMUP_EPOCHS (1.3) passes, answers cut
#            at 512 tokens and generated 512 at a time, every strategy of the engine's default set measured at
#            the end; beside it every `gpu` test (TESTS=0 leaves them out);
#   phase 2  its drafter: auto against off by batch size (1 / 8 / 32 / 128), interleaved rounds.
# Everything runs in the background; the call returns at once.
#
#   benchmarks/gpu_drafter_one.sh OUT QWEN05_GGUF     start it (the logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_drafter_one.sh --snapshot OUT DEST progress lines, and the small records so far
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q05=${2:?QWEN05_GGUF}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
share_cores 2
cfg05=configs/qwen2.5-0.5b-math-gpu.yaml
prompts=${WARMUP_PROMPTS:-5120}; epochs=${WARMUP_EPOCHS:-1.3}; tests=${TESTS:-1}

main() {
  local t0
  t0=$(date +%s)
  if [ "$tests" = 1 ]; then
    timeout 540 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1 &
  fi
  warm_up 0 "$cfg05" "$q05" "$prompts" "$epochs" "$out/w05"
  echo "warm-up done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  if [ ! -f "$out/w05/drafter/warmup.json" ]; then echo "no drafter: see w05.log" >> "$out/main.log"; wait; return 1; fi
  # shellcheck disable=SC2086  # the strategy list splits on purpose
  auto_off 0 "$q05" "$cfg05" "$out/w05/drafter" auto-off-q05 "1 8 32 128" --configs off auto --strategies $DEFAULT
  wait
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warm_up auto_off); $(declare -p out q05 cfg05 prompts epochs tests DEFAULT); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_drafter_one.sh --snapshot $out DEST"
