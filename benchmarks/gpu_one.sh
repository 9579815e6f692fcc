#!/usr/bin/env bash
# The real-model pass on one GPU (Qwen2.5-Coder-1.5B-Instruct), in the background:
#   1  the learner on random weights of the 1.5B shape, its layers compiled (rl.compile_layers, the default) and
#      eager, one after the other in one process (learner_step.py: MFU, memory against the dry run's forecast);
#   2  the drafter warm-up (WARMUP_PROMPTS prompts x 4 answers cut at WARMUP_MAX_NEW tokens, WARMUP_EPOCHS passes:
#      fresh answers pay more than passes: 448 / 768 / 1,024 prompts' gave 63% / 66% / 69% of the ceiling at the
#      same ~5.7M training tokens) beside every `gpu` test;
#   3  SD auto + tail training against SD off (configs/qwen2.5-1.5b-math-gpu.yaml, E2E_STEPS steps each, step 1's
#      learner update profiled);
#   4  auto against off by batch size in interleaved rounds (engine_throughput.py, T=1.0, the RL task's prompts);
#   5  (PROFILE=1) the decode step's kernels on the 1.5B shape (gpu_profile.sh without its learner parts).
#
#   benchmarks/gpu_one.sh OUT QWEN15_GGUF          start it (the logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_one.sh --snapshot OUT DEST      progress lines, and the small records so far in DEST/snapshot.tgz
# Settings: E2E_STEPS (16), E2E_SECONDS (480), WARMUP_PROMPTS (1024), WARMUP_EPOCHS (3), WARMUP_MAX_NEW (512; 0: the
# config's answer length), LEARNER_STEP (1; 0 leaves part 1 out), PROFILE (0; 1 adds part 5: gpu_profile.sh's
# decode-step parts).
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
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml
steps=${E2E_STEPS:-16}; budget=${E2E_SECONDS:-480}
prompts=${WARMUP_PROMPTS:-1024}; epochs=${WARMUP_EPOCHS:-3}; max_new=${WARMUP_MAX_NEW:-512}; profile=${PROFILE:-0}
curve=4
VARIANTS=("")

main() {
  local t0 drafter
  t0=$(date +%s)
  convert_target
  if [ "${LEARNER_STEP:-1}" = 1 ]; then
    timeout 300 python benchmarks/learner_step.py --config "$cfg1" --shape qwen2.5-coder-1.5b --rounds 4 \
        --fresh-batches --variants "" "rl.compile_layers=false" --out "$out/learner_step.jsonl" \
        > "$out/learner_step.log" 2>&1
    echo "learner_step done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  fi
  timeout 420 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1 &
  warmups  # VARIANTS' one entry: the default warm-up, into $out/w0
  wait
  echo "warm-up and tests done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  drafter=$out/w0/drafter
  if [ ! -f "$drafter/warmup.json" ]; then echo "no drafter: see warmup0.log" >> "$out/main.log"; return 1; fi
  python benchmarks/e2e_rl.py --config "$cfg1" --drafter "$drafter" --steps "$steps" --time-limit "$budget" \
      --out "$out/e2e1" -- "model.path=$q15" logging.profile_learner_step=1 > "$out/e2e1.log" 2>&1
  echo "e2e done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  python benchmarks/engine_throughput.py --target "$q15" --temperature 1 --task-config "$cfg1" \
      --drafter "$drafter" --configs off auto --interleave --learn-rounds 1 --repeats 3 --max-new-tokens 384 \
      --batch 1 8 32 128 --out "$out/throughput.jsonl" > "$out/throughput.log" 2>&1
  echo "throughput done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  if [ "$profile" = 1 ]; then  # the decode step's kernels: attention sweep, matmuls, whole steps (no learner)
    LEARNER="" benchmarks/gpu_profile.sh "$out/profile" > "$out/profile.log" 2>&1
  fi
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main convert_target warmups); $(declare -p VARIANTS out q15 cfg1 steps budget prompts \
    epochs curve max_new profile); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_one.sh --snapshot $out DEST"
