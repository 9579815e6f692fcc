#!/usr/bin/env bash
# The 4-GPU run on one 4-GPU machine (Qwen2.5-Coder-1.5B-Instruct, and the 0.5B where its GGUF is given; NCCL,
# NVLink multicast off):
#   phase 1  GPU 0:    the 1.5B drafter warm-up (WARMUP_PROMPTS (3,072) prompts x 4 answers, WARMUP_EPOCHS (1.5)
#                      passes, answers cut at 512 tokens and generated 512 at a time; every strategy of the
#                      engine's default set measured at the end);
#            GPUs 1-2: every `gpu` test (the tensor-parallel one takes both), then on GPU 2 the 1.5B model's decode
#                      step against its HBM floor (step_costs.py --profile), or with W05B_ARGS a second 0.5B
#                      warm-up with those e2e_rl.py arguments (e.g. "--warmup-arg=--unroll=5"); the 0.5B drafter
#                      with the higher accept / ceiling serves phase 2;
#            GPU 3:    the 0.5B warm-up (its own config's task and unrolled passes; WARMUP_PROMPTS05 (6,144) x
#                      WARMUP_EPOCHS05 (1.5), peak rate 9e-4)
#                      where QWEN05_GGUF is given;
#   phase 2  GPU 0:    auto against off per batch on the 1.5B drafter (interleaved; AUTO_OFF=0 leaves it out);
#            GPU 1:    the same on the 0.5B drafter, where there is one;
#            GPUs 2-3: a worker killed mid-rollout (SmolLM2, cluster.debug_fail): the step completes, nothing
#                      lost (KILL=0 leaves it out);
#   phase 3  GPUs 0-3: SD auto + idle-GPU drafter training against SD off with four data-parallel workers
#                      (configs/qwen2.5-1.5b-math-4gpu.yaml: the one- and two-GPU configs' RL step, each worker
#                      every prompt with 2 of its 8 answers), the warm-up's drafter in both;
#   phase 4  GPUs 0-3: TP=4 against TP=1 on the Qwen2.5-32B shape (tp_throughput.py: random bf16 weights, TP_SCALE
#                      of its layers, as many as one GPU holds for the TP=1 rows; plain decoding and 8_4_32 steps
#                      with a random replicated drafter, CUDA graphs); TP=0 leaves it out.
# Each job is its own process group with its own Ray (a private local cluster per driver), pinned by
# CUDA_VISIBLE_DEVICES, with a share of the host's cores (OMP_NUM_THREADS). Everything runs in the background;
# the call returns at once.
#
#   benchmarks/gpu_x4.sh OUT QWEN15_GGUF [QWEN05_GGUF]   start it (the logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_x4.sh --snapshot OUT DEST             progress lines, and the small records so far in DEST/snapshot.tgz
# Settings: E2E4_STEPS (16), E2E4_SECONDS (600), WARMUP_PROMPTS (3072), WARMUP_EPOCHS (1.5), WARMUP_PROMPTS05 (6144),
# WARMUP_EPOCHS05 (1.5), TP_SCALE (0.5), TP (1), AUTO_OFF (1), KILL (1), E2E4 (1: phase 3; 0 leaves it out), W05B_ARGS
# (empty: no second 0.5B warm-up).
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q15=${2:?QWEN15_GGUF}; q05=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
share_cores 4
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml; cfg4=configs/qwen2.5-1.5b-math-4gpu.yaml; cfg05=configs/qwen2.5-0.5b-math-gpu.yaml
steps4=${E2E4_STEPS:-16}; budget4=${E2E4_SECONDS:-600}
prompts=${WARMUP_PROMPTS:-3072}; epochs=${WARMUP_EPOCHS:-1.5}; tp_scale=${TP_SCALE:-0.5}; kill=${KILL:-1}
p05=${WARMUP_PROMPTS05:-6144}; e05=${WARMUP_EPOCHS05:-1.5}; tp=${TP:-1}; timings=${AUTO_OFF:-1}; e2e4=${E2E4:-1}
w05b=${W05B_ARGS:-}
VARIANTS=("--warmup-arg=--gen-batch=512")

main() {
  local t0 best drafter d05 r05 r05b
  t0=$(date +%s)
  (   # GPU 3: the 0.5B warm-up (it converts its own GGUF)
    if [ -n "$q05" ]; then
      warm_up 3 "$cfg05" "$q05" "$p05" "$e05" "$out/w05" --warmup-arg=--lr=9e-4
      echo "0.5B warm-up done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
    fi
  ) &
  convert_target
  (   # GPUs 1-2: the tests; then GPU 2: the decode step against its floor
    CUDA_VISIBLE_DEVICES=1,2 timeout 540 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
    echo "tests done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
    if [ -n "$w05b" ] && [ -n "$q05" ]; then
      # shellcheck disable=SC2086  # the variant's arguments split on purpose
      warm_up 2 "$cfg05" "$q05" "$p05" "$e05" "$out/w05b" --warmup-arg=--lr=9e-4 $w05b
      echo "second 0.5B warm-up done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
    else
      CUDA_VISIBLE_DEVICES=2 timeout 150 python benchmarks/step_costs.py --model "$q15" --batch 1 8 32 --ctx 1024 \
          --verify 16 48 --profile --out "$out/step_costs.jsonl" > "$out/step_costs.log" 2>&1
    fi
  ) &
  warmups
  echo "warm-up done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  wait
  echo "phase 1 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  best=$(best_warmup)
  if [ "$best" -lt 0 ]; then echo "no warm-up finished: see warmup*.log" >> "$out/choice.txt"; return 1; fi
  drafter=$out/w$best/drafter
  echo "chosen: variant $best, $drafter" >> "$out/choice.txt"
  if [ "$timings" = 1 ]; then
    # shellcheck disable=SC2086  # the strategy list splits on purpose
    auto_off 0 "$q15" "$cfg1" "$drafter" auto-off-q15 "1 8 32 128" --configs off auto --strategies $DEFAULT &
    d05=$out/w05; r05=$(warmup_ratio "$out/w05"); r05b=$(warmup_ratio "$out/w05b")
    if [ "$r05b" -gt "$r05" ]; then d05=$out/w05b; fi
    echo "0.5B: w05 $r05, w05b $r05b x1000: $d05" >> "$out/choice.txt"
    if [ -f "$d05/drafter/warmup.json" ]; then
      # shellcheck disable=SC2086
      auto_off 1 "$q05" "$cfg05" "$d05/drafter" auto-off-q05 "1 8 32 128" --configs off auto --strategies $DEFAULT &
    fi
  fi
  if [ "$kill" = 1 ]; then kill_run 2,3; fi
  wait
  echo "phase 2 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  if [ "$e2e4" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0,1,2,3 python benchmarks/e2e_rl.py --config "$cfg4" --drafter "$drafter" --steps "$steps4" \
        --time-limit "$budget4" --out "$out/e2e4" -- "model.path=$q15" > "$out/e2e4.log" 2>&1
    echo "four-GPU run done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  fi
  if [ "$tp" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0,1,2,3 timeout -s USR1 -k 15 420 python benchmarks/tp_throughput.py --shape qwen2.5-32b \
        --tp 4 --scale "$tp_scale" --batch 1 8 32 --max-new-tokens 128 --sd 8_4_32 > "$out/tp4.log" 2>&1
  fi
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warmups best_warmup warmup_ratio kill_run convert_target warm_up auto_off); $(declare -p VARIANTS DEFAULT out q15 q05 cfg1 cfg4 cfg05 steps4 budget4 prompts epochs p05 e05 tp_scale tp timings kill e2e4 w05b); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_x4.sh --snapshot $out DEST"
