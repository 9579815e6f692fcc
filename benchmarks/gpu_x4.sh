#!/usr/bin/env bash
# The real-model pass on one 4-GPU machine, every GPU busy at once (Qwen2.5-Coder-1.5B-Instruct):
#   phase 1  GPUs 0-1: two drafter warm-ups side by side, one drafter each (VARIANTS below: on 384 and on 768
#                      prompts' answers; EAGLE-3's fused features, `--warmup-arg=--feature-layers=auto`, measured
#                      level with the one layer at 77e8b8a);
#            GPU 2:    every `gpu` test, then the decode step against its HBM floor (step_costs.py --profile,
#                      the projections through cuBLAS and through the skinny Triton matmul), the decode
#                      attention's launch sweep on the model's heads, and the learner's update on fresh
#                      batches under the profiler (learner_step.py);
#            GPU 3:    verl's GRPO with our rollout backend, its drafter trained whenever the server is idle
#                      (benchmarks/gpu_verl.sh, the 0.5B model), when its GGUF and the verl kit are here;
#   phase 2  the warm-up with the highest accept / ceiling serves every run below:
#            GPUs 0-1: SD auto + idle-GPU drafter training against SD off on two GPUs
#                      (configs/qwen2.5-1.5b-math-2gpu.yaml, cluster.split=samples: each worker every prompt,
#                      half of its answers);
#            GPU 2:    the same comparison on one GPU (tail training; configs/qwen2.5-1.5b-math-gpu.yaml), step 1's
#                      learner update profiled in both runs (RUN/profile/);
#            GPU 3:    auto against off by batch size in interleaved rounds (engine_throughput.py);
#            then GPUs 2-3: a worker killed mid-rollout (SmolLM2, cluster.debug_fail): the step completes,
#                      nothing lost.
# Each job is its own process group with its own Ray (a private local cluster per driver), pinned by
# CUDA_VISIBLE_DEVICES, with a share of the host's cores (OMP_NUM_THREADS): in the pass of 2026-11-26 three
# warm-ups at once, each free to use every core, trained at a third of one alone's speed. Everything runs in the
# background; the call returns at once. The passes of 2026-11-26 ran this script as it was at their commits.
#
#   benchmarks/gpu_x4.sh OUT QWEN15_GGUF [QWEN05_GGUF]    start it (the logs: OUT/*.log)
#   benchmarks/gpu_x4.sh --snapshot OUT DEST              progress lines, and the small records so far packed
#                                                         into DEST/snapshot.tgz
# Settings: E2E_STEPS (16), E2E_SECONDS (420 per comparison), WARMUP_PROMPTS (384).
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  out=${2:?OUT}; dest=${3:?DEST}
  for f in "$out"/*.log; do [ -f "$f" ] && printf '%s: %s\n' "$(basename "$f")" "$(tail -c 300 "$f" | tail -n 2 | tr '\n' ' ')"; done
  cat "$out/choice.txt" 2>/dev/null
  (cd "$out" && find . -maxdepth 6 \( -name '*.log' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.txt' \
      -o -name 'warmup.json' \) -size -4M -print0 | tar czf "$dest/snapshot.tgz" --null -T -)
  exit 0
fi
out=${1:?OUT}; q15=${2:?QWEN15_GGUF}; q05=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
share_cores 4
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml; cfg2=configs/qwen2.5-1.5b-math-2gpu.yaml
steps=${E2E_STEPS:-16}; budget=${E2E_SECONDS:-420}; prompts=${WARMUP_PROMPTS:-384}
# the warm-ups compared: the default data and twice its fresh answers (a variant may also be a drafter's shape,
# e.g. "--warmup-arg=--feature-layers=auto": the drafter's folder carries its layers into the RL runs)
VARIANTS=("" "--warmup-prompts 768")
# the RL runs' drafter.* keys that go with each
ONLINE=("" "")

main() {
  local t0 best drafter keys
  t0=$(date +%s)
  convert_target
  (   # GPU 2: the tests, then the decode step against its floor, the attention sweep, the learner
    export CUDA_VISIBLE_DEVICES=2
    timeout 420 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
    for v in cublas skinny; do
      flag=""; [ "$v" = skinny ] && flag=--skinny
      # shellcheck disable=SC2086
      timeout 150 python benchmarks/step_costs.py --model "$q15" --batch 1 8 32 --ctx 1024 --verify 16 48 \
          --profile --label "$v" --out "$out/step_costs.jsonl" $flag >> "$out/step_costs.log" 2>&1
    done
    timeout 120 python benchmarks/bench_attention.py --tune --shape qwen2.5-coder-1.5b --decode 1x1024 8x1024 \
        32x1024 --best-out "$out/attention_best.json" > "$out/attention_tune.log" 2>&1
    timeout 150 python benchmarks/learner_step.py --config "$cfg1" --shape qwen2.5-coder-1.5b --variants "" \
        --rounds 4 --fresh-batches --profile --out "$out/learner_step.jsonl" > "$out/learner_step.log" 2>&1
    touch "$out/gpu2.done"
  ) &
  (   # GPU 3: verl, its drafter trained whenever the server has no request
    export CUDA_VISIBLE_DEVICES=3
    if [ -n "$q05" ] && [ -f /tmp/verl-kit/p01.tar.xz ]; then
      # verl's packages in a folder of their own, so the other jobs never import them
      VERL_KIT_SITE=/tmp/site-verl source .verl-kit/unpack.sh > "$out/verl_kit.log" 2>&1 &&
        VERL_TIMEOUT=600 benchmarks/gpu_verl.sh "$out/verl" "$q05" \
          +actor_rollout_ref.rollout.engine_kwargs.tlt_rt.drafter_training=true > "$out/verl.log" 2>&1
    fi
    touch "$out/gpu3.done"
  ) &
  warmups
  echo "warm-ups done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  best=$(best_warmup)
  if [ "$best" -lt 0 ]; then echo "no warm-up finished: see warmup*.log" >> "$out/choice.txt"; return 1; fi
  drafter=$out/w$best/drafter; keys=${ONLINE[$best]}
  echo "chosen: variant $best, $drafter, online keys: ${keys:-none}" >> "$out/choice.txt"
  while [ ! -f "$out/gpu2.done" ] || [ ! -f "$out/gpu3.done" ]; do sleep 5; done
  (   # GPUs 0-1: two GPUs, the answers of each prompt split over the workers
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/e2e_rl.py --config "$cfg2" --drafter "$drafter" --steps "$steps" \
        --time-limit "$budget" --out "$out/e2e2" -- "model.path=$q15" cluster.split=samples $keys \
        > "$out/e2e2.log" 2>&1
  ) &
  (   # GPU 3: auto against off by batch size
    CUDA_VISIBLE_DEVICES=3 python benchmarks/engine_throughput.py --target "$q15" --temperature 1 \
        --task-config "$cfg1" --drafter "$drafter" --configs off auto --interleave --learn-rounds 1 --repeats 3 \
        --max-new-tokens 384 --batch 1 8 32 128 --out "$out/throughput.jsonl" > "$out/throughput.log" 2>&1
    touch "$out/gpu3.done2"
  ) &
  (   # GPU 2: one GPU, then (with GPU 3 free) a worker killed mid-rollout (SmolLM2, 3 steps, two GPU workers)
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=2 python benchmarks/e2e_rl.py --config "$cfg1" --drafter "$drafter" --steps "$steps" \
        --time-limit "$budget" --out "$out/e2e1" -- "model.path=$q15" logging.profile_learner_step=1 $keys \
        > "$out/e2e1.log" 2>&1
    while [ ! -f "$out/gpu3.done2" ]; do sleep 5; done
    kill_run 2,3
  ) &
  wait
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warmups best_warmup kill_run convert_target); $(declare -p VARIANTS ONLINE out q15 q05 cfg1 cfg2 steps budget prompts); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_x4.sh --snapshot $out DEST"
