#!/usr/bin/env bash
# The 4-GPU run on one 4-GPU machine (Qwen2.5-Coder-1.5B-Instruct; NCCL, NVLink multicast off):
#   phase 1  GPU 0:    the 1.5B checkpoint converted, then the 1.5B drafter warm-up (WARMUP_PROMPTS (3,072) prompts
#                      x 4 answers, WARMUP_EPOCHS (1.5) passes, answers cut at 512 tokens and generated 512 at a
#                      time, the config's training-time-test passes; every strategy of the engine's default set
#                      measured at the end);
#            GPU 1:    a second 1.5B warm-up beside it with W15B_ARGS (default "--warmup-arg=--unroll=5": five
#                      passes; empty: none); the drafter with the higher accept / ceiling serves the phases after;
#            GPUs 2-3: every `gpu` test in two halves, one GPU each, with the two-GPU TP test beside them (TESTS=0
#                      leaves them out);
#   phase 2  GPU 0:    auto against off per batch on the chosen drafter (interleaved; AUTO_OFF=1, default off);
#            GPUs 2-3: a worker killed mid-rollout (SmolLM2, cluster.debug_fail): the step completes, nothing
#                      lost (KILL=1, default off);
#   phase 3  GPUs 0-3: SD auto + idle-GPU drafter training against SD off with four data-parallel workers
#                      (configs/qwen2.5-1.5b-math-4gpu.yaml: the one- and two-GPU configs' RL step, each worker
#                      every prompt with 2 of its 8 answers), the chosen drafter in both, trained online with the
#                      passes it was warmed up with; E2E4_STEPS (20) steps in E2E4_SECONDS (540) at most (E2E4=0
#                      leaves it out); E2E4_SEEDS="1 2 ..." runs a pair per seed in that time (seeds.md: the
#                      reward gap against the seeds' spread), E2E4_HOLD=1 with the policy held still (rl.lr=0);
#   phase 4  GPUs 0-3: TP=4 against TP=1 on the Qwen2.5-32B shape (tp_throughput.py: random bf16 weights, TP_SCALE
#                      (0.5) of its layers, as many as one GPU holds for the TP=1 rows; batch 1 and 32, plain decoding
#                      and 8_4_32 steps with a random replicated drafter, CUDA graphs, NCCL and the one-shot sum); TP=0 leaves
#                      it out.
# Each job is its own process group with its own Ray (a private local cluster per driver), pinned by
# CUDA_VISIBLE_DEVICES, with a share of the host's cores (OMP_NUM_THREADS). Everything runs in the background;
# the call returns at once.
#
#   benchmarks/gpu_x4.sh OUT QWEN15_GGUF          start it (the logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_x4.sh --snapshot OUT DEST      progress lines, and the small records so far in DEST/snapshot.tgz
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q15=${2:?QWEN15_GGUF}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
share_cores 4
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml; cfg4=configs/qwen2.5-1.5b-math-4gpu.yaml
steps4=${E2E4_STEPS:-20}; budget4=${E2E4_SECONDS:-540}
prompts=${WARMUP_PROMPTS:-3072}; epochs=${WARMUP_EPOCHS:-1.5}; tp_scale=${TP_SCALE:-0.5}; kill=${KILL:-0}
tp=${TP:-1}; timings=${AUTO_OFF:-0}; e2e4=${E2E4:-1}; tests=${TESTS:-1}; limit=${TESTS_SECONDS:-540}
e2e4_more=(); if [ -n "${E2E4_SEEDS:-}" ]; then read -r -a e2e4_more <<< "--seeds $E2E4_SEEDS"; fi
if [ "${E2E4_HOLD:-0}" = 1 ]; then e2e4_more+=(--hold-policy); fi
VARIANTS=("--warmup-arg=--gen-batch=512")
w15b=${W15B_ARGS---warmup-arg=--unroll=5}
if [ -n "$w15b" ]; then VARIANTS+=("--warmup-arg=--gen-batch=512 $w15b"); fi

# unroll_keys VARIANT: the RL runs' key for a warm-up variant's training-time-test passes (none: the config's)
unroll_keys() {
  if [[ "$1" =~ --unroll=([0-9]+) ]]; then echo "drafter.unroll=${BASH_REMATCH[1]}"; fi
}

main() {
  local t0 best drafter keys
  t0=$(date +%s)
  if [ "$tests" = 1 ]; then
    (   # GPUs 2-3: the tests
      test_half 3 0 &
      test_half 2 1 &
      tp_test 2,3 "$limit"
      wait
      echo "tests done at $(( $(date +%s) - t0 )) s: $(tail -n 1 "$out/tests0.log") | $(tail -n 1 "$out/tests1.log") | TP $(tail -n 1 "$out/tests_tp.log")" >> "$out/main.log"
    ) &
  fi
  convert_target
  warmups
  echo "warm-ups done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  wait
  echo "phase 1 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  best=$(best_warmup)
  if [ "$best" -lt 0 ]; then echo "no warm-up finished: see warmup*.log" >> "$out/main.log"; return 1; fi
  drafter=$out/w$best/drafter
  keys=$(unroll_keys "${VARIANTS[$best]}")
  echo "chosen: variant $best, $drafter ${keys:-(online: the passes of the config)}" >> "$out/choice.txt"
  if [ "$timings" = 1 ]; then
    # shellcheck disable=SC2086  # the strategy list splits on purpose
    auto_off 0 "$q15" "$cfg1" "$drafter" auto-off-q15 "1 8 32 128" --configs off auto --strategies $DEFAULT &
  fi
  if [ "$kill" = 1 ]; then kill_run 2,3; fi
  wait
  echo "phase 2 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  if [ "$e2e4" = 1 ]; then
    # shellcheck disable=SC2086  # no key when empty
    CUDA_VISIBLE_DEVICES=0,1,2,3 python benchmarks/e2e_rl.py --config "$cfg4" --drafter "$drafter" --steps "$steps4" \
        --time-limit "$budget4" --out "$out/e2e4" "${e2e4_more[@]}" -- "model.path=$q15" $keys > "$out/e2e4.log" 2>&1
    echo "four-GPU run done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  fi
  if [ "$tp" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0,1,2,3 timeout -s USR1 -k 15 420 python benchmarks/tp_throughput.py --shape qwen2.5-32b \
        --tp 4 --scale "$tp_scale" --batch 1 32 --max-new-tokens 128 --sd 8_4_32 --allreduce nccl oneshot \
        > "$out/tp4.log" 2>&1
    echo "TP=4 rows done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  fi
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warmups best_warmup warmup_ratio unroll_keys kill_run convert_target auto_off test_half tp_test); $(declare -p VARIANTS DEFAULT HALF0 HALF1 e2e4_more out q15 cfg1 cfg4 steps4 budget4 prompts epochs tp_scale tp timings kill e2e4 tests limit); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_x4.sh --snapshot $out DEST"
