#!/usr/bin/env bash
# The 4-GPU run on one 4-GPU machine (Qwen2.5-Coder-1.5B-Instruct; NCCL, NVLink multicast off):
#   phase 1  GPU 0:    the drafter warm-up (WARMUP_PROMPTS prompts x 4 answers, WARMUP_EPOCHS passes, answers cut at
#                      512 tokens; every strategy of the engine's default set measured at the end);
#            GPU 1:    every `gpu` test;
#            GPU 2:    the 1.5B model's decode step against its HBM floor (step_costs.py --profile);
#            GPUs 2-3: then a worker killed mid-rollout (SmolLM2, cluster.debug_fail): the step completes, nothing
#                      lost (KILL=0 leaves it out);
#   phase 2  GPUs 0-3: SD auto + idle-GPU drafter training against SD off with four data-parallel workers
#                      (configs/qwen2.5-1.5b-math-4gpu.yaml: the one- and two-GPU configs' RL step, each worker
#                      every prompt with 2 of its 8 answers), the warm-up's drafter in both;
#   phase 3  GPUs 0-3: TP=4 against TP=1 on the Qwen2.5-32B shape (tp_throughput.py: random bf16 weights, TP_SCALE
#                      of its layers, as many as one GPU holds for the TP=1 rows; plain decoding and 8_4_32 steps
#                      with a random replicated drafter, CUDA graphs).
# Each job is its own process group with its own Ray (a private local cluster per driver), pinned by
# CUDA_VISIBLE_DEVICES, with a share of the host's cores (OMP_NUM_THREADS). Everything runs in the background;
# the call returns at once. (Until 2026-11-26 this script was the four-GPU pass of the journal's third and fourth
# passes: two warm-ups, verl, the one- and two-GPU comparisons; see its history.)
#
#   benchmarks/gpu_x4.sh OUT QWEN15_GGUF          start it (the logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_x4.sh --snapshot OUT DEST      progress lines, and the small records so far in DEST/snapshot.tgz
# Settings: E2E4_STEPS (16), E2E4_SECONDS (600), WARMUP_PROMPTS (1024), WARMUP_EPOCHS (3), TP_SCALE (0.5), KILL (1).
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q15=${2:?QWEN15_GGUF}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
share_cores 4
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml; cfg4=configs/qwen2.5-1.5b-math-4gpu.yaml
steps4=${E2E4_STEPS:-16}; budget4=${E2E4_SECONDS:-600}
prompts=${WARMUP_PROMPTS:-1024}; epochs=${WARMUP_EPOCHS:-3}; tp_scale=${TP_SCALE:-0.5}; kill=${KILL:-1}
VARIANTS=("")

main() {
  local t0 best drafter
  t0=$(date +%s)
  convert_target
  (   # GPU 1: the tests
    CUDA_VISIBLE_DEVICES=1 timeout 480 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
  ) &
  (   # GPU 2: the decode step against its floor; then GPUs 2-3: the killed worker
    CUDA_VISIBLE_DEVICES=2 timeout 150 python benchmarks/step_costs.py --model "$q15" --batch 1 8 32 --ctx 1024 \
        --verify 16 48 --profile --out "$out/step_costs.jsonl" > "$out/step_costs.log" 2>&1
    if [ "$kill" = 1 ]; then kill_run 2,3; fi
  ) &
  warmups
  echo "warm-up done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  wait
  echo "phase 1 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  best=$(best_warmup)
  if [ "$best" -lt 0 ]; then echo "no warm-up finished: see warmup*.log" >> "$out/choice.txt"; return 1; fi
  drafter=$out/w$best/drafter
  echo "chosen: variant $best, $drafter" >> "$out/choice.txt"
  CUDA_VISIBLE_DEVICES=0,1,2,3 python benchmarks/e2e_rl.py --config "$cfg4" --drafter "$drafter" --steps "$steps4" \
      --time-limit "$budget4" --out "$out/e2e4" -- "model.path=$q15" > "$out/e2e4.log" 2>&1
  echo "four-GPU run done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  CUDA_VISIBLE_DEVICES=0,1,2,3 timeout -s USR1 -k 15 420 python benchmarks/tp_throughput.py --shape qwen2.5-32b \
      --tp 4 --scale "$tp_scale" --batch 1 8 32 --max-new-tokens 128 --sd 8_4_32 > "$out/tp4.log" 2>&1
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warmups best_warmup kill_run convert_target); $(declare -p VARIANTS out q15 cfg1 cfg4 steps4 budget4 prompts epochs tp_scale kill); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_x4.sh --snapshot $out DEST"
