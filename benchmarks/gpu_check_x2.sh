#!/usr/bin/env bash
# The GPU tests at a commit on one 2-GPU machine, split over both GPUs, then what needs no model file:
#   phase 1  GPU 0: the engine, drafter and IR `gpu` tests;  GPU 1: every other one but the two-GPU TP test,
#            then the eager phases of a rollout on the Qwen2.5-Coder-1.5B shape (eager_profile.py: a batch's
#            prefill, and a speculative step that first catches the drafter up on a plain stretch; profiled);
#   phase 2  GPUs 0-1: the two-GPU tensor-parallel test, then TP=2 against TP=1 on the Qwen2.5-7B shape
#            (tp_throughput.py: bf16, every layer, CUDA graphs, plain and 8_4_32 steps at batch 1 and 32, the TP=2
#            sums through NCCL and through the one-shot all-reduce); TP=0 leaves the throughput rows out.
# The models the tests read come from the environment (TLT_SMOLLM2_GGUF, TLT_QWEN_GGUF: a test whose model is not
# there skips). Everything runs in the background; the call returns at once.
#
#   benchmarks/gpu_check_x2.sh OUT                 start it (the logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_check_x2.sh --snapshot OUT DEST progress lines, and the small records so far in DEST/snapshot.tgz
# Settings: TESTS_SECONDS (330, each half), TP (1).
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
share_cores 2
limit=${TESTS_SECONDS:-330}; tp=${TP:-1}

main() {
  local t0
  t0=$(date +%s)
  (
    test_half 0 0
    echo "tests on GPU 0 done at $(( $(date +%s) - t0 )) s: $(tail -n 1 "$out/tests0.log")" >> "$out/main.log"
  ) &
  (
    test_half 1 1
    echo "tests on GPU 1 done at $(( $(date +%s) - t0 )) s: $(tail -n 1 "$out/tests1.log")" >> "$out/main.log"
    CUDA_VISIBLE_DEVICES=1 timeout 200 python benchmarks/eager_profile.py --model qwen2.5-coder-1.5b --batch 128 \
        --prompt-len 96 --plain-steps 80 --out "$out/eager" > "$out/eager.log" 2>&1
    echo "eager profile done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  ) &
  wait
  CUDA_VISIBLE_DEVICES=0,1 timeout 600 python -m pytest -q -p no:cacheprovider -m gpu tests/test_tp_gpu.py \
      > "$out/tests_tp.log" 2>&1
  echo "TP test done at $(( $(date +%s) - t0 )) s: $(tail -n 1 "$out/tests_tp.log")" >> "$out/main.log"
  if [ "$tp" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0,1 timeout -s USR1 -k 15 270 python benchmarks/tp_throughput.py --shape qwen2.5-7b --tp 2 \
        --batch 1 32 --max-new-tokens 128 --sd 8_4_32 --allreduce nccl oneshot > "$out/tp2.log" 2>&1
  fi
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main test_half); $(declare -p out limit tp HALF0 HALF1); main" > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_check_x2.sh --snapshot $out DEST"
