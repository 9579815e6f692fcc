#!/usr/bin/env bash
# Where one GPU's time goes on the Qwen2.5-Coder shapes, for the learner and the decode step:
#   1. the learner inside an RL run (SD off, 5 steps, step 3's update under the profiler: RUN/profile/), with the
#      1.5B config's learner settings (full activations, 8k-token micro-batches), when a Qwen GGUF is given;
#   2. the learner alone on random 1.5B weights (learner_step.py), on one batch reused and on fresh batches;
#   3. the decode attention's launch sweep on the 1.5B heads (bench_attention.py --tune --shape);
#   4. the decode matmuls of the 1.5B shapes, cuBLAS against the skinny kernel (bench_linear.py --tune);
#   5. the whole decode step (step_costs.py): cuBLAS, the skinny kernel where the default rule takes it, and the
#      skinny kernel for every one-row matmul.
#
#   benchmarks/gpu_profile.sh OUT [QWEN_GGUF [CONFIG]]      (CONFIG default configs/qwen2.5-0.5b-math-gpu.yaml)
# LEARNER="" (empty) leaves part 2 out.
set -u
out=${1:?OUT}; gguf=${2:-}; cfg=${3:-configs/qwen2.5-0.5b-math-gpu.yaml}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
shape=qwen2.5-coder-1.5b
LEARNER=${LEARNER-1}
t0=$(date +%s)
note() { echo "$1 at $(( $(date +%s) - t0 )) s" >> "$out/main.log"; }
if [ -n "$gguf" ]; then
  timeout 300 python -m tlt_rt.train "$cfg" name=learner "output_dir=$out/run" "model.path=$gguf" \
      rollout.speculative=off rl.steps=5 logging.profile_learner_step=3 logging.eval_every=0 rl.checkpoint_every=0 \
      rl.activation_checkpointing=false rl.micro_batch_tokens=8192 > "$out/run.log" 2>&1
  note "run done"
fi
for fresh in ${LEARNER:+"" --fresh-batches}; do
  # shellcheck disable=SC2086
  timeout 150 python benchmarks/learner_step.py --config configs/qwen2.5-1.5b-math-gpu.yaml --shape "$shape" \
      --variants "" --rounds 4 --profile $fresh --out "$out/learner_step.jsonl" >> "$out/learner_step.log" 2>&1
done
note "learner_step done"
timeout 120 python benchmarks/bench_attention.py --tune --shape "$shape" --decode 1x1024 8x1024 32x1024 \
    --best-out "$out/attention_best.json" > "$out/attention_tune.log" 2>&1
note "attention done"
timeout 150 python benchmarks/bench_linear.py --model "$shape" --rows 1 4 8 --tune --tune-rows 1 \
    --out "$out/linear.jsonl" > "$out/linear.log" 2>&1
note "linear done"
for v in cublas skinny skinny-all; do
  flags=""
  [ "$v" = skinny ] && flags="--skinny"
  [ "$v" = skinny-all ] && flags="--skinny --skinny-min-weight 0"
  # shellcheck disable=SC2086
  timeout 150 python benchmarks/step_costs.py --model "$shape" --batch 1 8 32 --ctx 1024 --verify 16 --profile \
      --label "$v" --out "$out/step_costs.jsonl" $flags >> "$out/step_costs.log" 2>&1
done
note "all done"
