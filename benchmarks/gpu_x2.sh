#!/usr/bin/env bash
# The real-model pass on one 2-GPU machine (Qwen2.5-Coder-1.5B-Instruct), both GPUs busy throughout:
#   phase 1  GPU 0 and GPU 1: two drafter warm-ups side by side (VARIANTS: the one-layer drafter on 1,024 prompts'
#            answers over 3 passes, and on 1,536 prompts' over 2: fresh data keeps paying, 448 / 768 / 1,024 prompts'
#            answers reached 63% / 66% / 69% of the ceiling at the same ~5.7M training tokens; more passes over 448
#            prompts' stayed at 60-63%, and EAGLE-3's fused features gave the same accept as the one layer);
#   phase 2  the warm-up with the highest accept / ceiling serves every run below:
#            GPU 0: SD auto + tail training against SD off on one GPU (configs/qwen2.5-1.5b-math-gpu.yaml), step 1's
#                   learner update profiled in both runs (RUN/profile/; a step before the timed ones: the
#                   profiler slows it by seconds, which in the pass at 77e8b8a landed in the timed means);
#            GPU 1: auto against off by batch size in interleaved rounds (engine_throughput.py), or with
#                   GPU1=tests every `gpu` test instead (then phase 4 runs no tests);
#   phase 3  GPUs 0-1: SD auto + idle-GPU drafter training against SD off on two GPUs
#            (configs/qwen2.5-1.5b-math-2gpu.yaml, cluster.split=samples);
#   phase 4  every `gpu` test on GPU 1, beside a worker killed mid-rollout on GPUs 0-1 (SmolLM2,
#            cluster.debug_fail): the step completes, nothing lost. Neither times anything. KILL=0 leaves the
#            killed worker out.
# Each job is its own process group with its own Ray (a private local cluster per driver), pinned by
# CUDA_VISIBLE_DEVICES, with half the host's cores (OMP_NUM_THREADS). Everything runs in the background; the call
# returns at once.
#
#   benchmarks/gpu_x2.sh OUT QWEN15_GGUF          start it (the logs: OUT/*.log)
#   benchmarks/gpu_x2.sh --snapshot OUT DEST      progress lines, and the small records so far in DEST/snapshot.tgz
# Settings: E2E_STEPS (16) and E2E_SECONDS (480) for the one-GPU comparison, E2E2_STEPS (22) and E2E2_SECONDS
# (600) for the two-GPU one, WARMUP_PROMPTS (1024), WARMUP_EPOCHS (3), VARIANTS (the two warm-ups' extra e2e_rl.py
# arguments, each one string: default "" and "--warmup-prompts 1536 --warmup-epochs 2"), GPU1 (throughput | tests),
# KILL (1).
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q15=${2:?QWEN15_GGUF}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
share_cores 2
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml; cfg2=configs/qwen2.5-1.5b-math-2gpu.yaml
steps=${E2E_STEPS:-16}; budget=${E2E_SECONDS:-480}; prompts=${WARMUP_PROMPTS:-1024}; epochs=${WARMUP_EPOCHS:-3}
# the two-GPU comparison runs longer: 20 steps after its warm-up average the sampled tails' luck and give the
# online drafter's curve against its frozen start over 20 RL steps
steps2=${E2E2_STEPS:-22}; budget2=${E2E2_SECONDS:-600}
if [ -n "${VARIANT0+x}${VARIANT1+x}" ]; then VARIANTS=("${VARIANT0:-}" "${VARIANT1:-}"); else VARIANTS=("" "--warmup-prompts 1536 --warmup-epochs 2"); fi
gpu1=${GPU1:-throughput}; kill=${KILL:-1}
case "$gpu1" in throughput|tests) ;; *) echo "GPU1 must be throughput or tests, got $gpu1" >&2; exit 2 ;; esac

main() {
  local t0 best drafter
  t0=$(date +%s)
  convert_target
  warmups
  echo "warm-ups done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  best=$(best_warmup)
  if [ "$best" -lt 0 ]; then echo "no warm-up finished: see warmup*.log" >> "$out/choice.txt"; return 1; fi
  drafter=$out/w$best/drafter
  echo "chosen: variant $best, $drafter" >> "$out/choice.txt"
  (
    CUDA_VISIBLE_DEVICES=0 python benchmarks/e2e_rl.py --config "$cfg1" --drafter "$drafter" --steps "$steps" \
        --time-limit "$budget" --out "$out/e2e1" -- "model.path=$q15" logging.profile_learner_step=1 \
        > "$out/e2e1.log" 2>&1
  ) &
  if [ "$gpu1" = tests ]; then
    CUDA_VISIBLE_DEVICES=1 timeout 480 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1 &
  else (
    export CUDA_VISIBLE_DEVICES=1
    python benchmarks/engine_throughput.py --target "$q15" --temperature 1 --task-config "$cfg1" \
        --drafter "$drafter" --configs off auto --interleave --learn-rounds 1 --repeats 3 --max-new-tokens 384 \
        --batch 1 8 32 128 --out "$out/throughput.jsonl" > "$out/throughput.log" 2>&1
  ) & fi
  wait
  echo "phase 2 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  CUDA_VISIBLE_DEVICES=0,1 python benchmarks/e2e_rl.py --config "$cfg2" --drafter "$drafter" --steps "$steps2" \
      --time-limit "$budget2" --out "$out/e2e2" -- "model.path=$q15" cluster.split=samples > "$out/e2e2.log" 2>&1
  echo "two-GPU run done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  if [ "$gpu1" != tests ]; then
    CUDA_VISIBLE_DEVICES=1 timeout 420 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1 &
  fi
  if [ "$kill" = 1 ]; then kill_run 0,1; fi
  wait
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warmups best_warmup warmup_ratio kill_run convert_target); $(declare -p VARIANTS out q15 cfg1 cfg2 steps budget steps2 budget2 prompts epochs gpu1 kill); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_x2.sh --snapshot $out DEST"
