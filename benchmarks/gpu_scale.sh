#!/usr/bin/env bash
# Scale-out pass on a 2-GPU machine (NCCL, NVLink multicast off): TP=2 vs TP=1 engine throughput and greedy
# equality for the Qwen2.5-7B shape and a layer-scaled Llama-3-70B shape; an RL run with 2 data-parallel
# workers (spot drafter training on the one that finishes first); an RL run with one TP=2 engine.
# Usage: benchmarks/gpu_scale.sh OUTDIR [RL_STEPS]
set -u
out=$1 steps=${2:-4}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 RAY_AUTH_MODE=disabled
cfg=configs/smollm2-arith-gpu.yaml
python -m tlt_rt.models.default > "$out/model.log" 2>&1
tp() {  # name, seconds, then options (a run past its time dumps every thread's stack, then stops)
  local name=$1 secs=$2
  shift 2
  timeout -s USR1 -k 15 "$secs" python benchmarks/tp_throughput.py "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$?"
  grep -E "^TP=|^\|" "$out/$name.log" | tail -n 8
}
tp tp-7b-eager "${TP_SECS:-120}" --shape qwen2.5-7b --batch 1 8 --max-new-tokens 32 --eager
[ "${TP_GRAPHS:-1}" = 1 ] && tp tp-7b-graphs "${TP_SECS:-120}" --shape qwen2.5-7b --batch 1 8 --max-new-tokens 32
rl() {  # name, seconds, then keys
  local name=$1 secs=$2
  shift 2
  timeout "$secs" python -m tlt_rt.train "$cfg" name="$name" output_dir="$out/runs" rl.steps="$steps" \
      rollout.max_new_tokens=256 "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? $(grep -c '"step"' "$out/runs/$name/metrics.jsonl" 2>/dev/null || echo 0) steps"
  grep -E "^step|Error|error" "$out/$name.log" | grep -v logging.cc | tail -n 4
}
[ "${DP2:-1}" = 1 ] && rl dp2 150 cluster.num_workers=2 cluster.gpus_per_worker=1
python benchmarks/random_policy.py --out "$out/random-policy" > /dev/null
rl tp2 "${RL_SECS:-150}" model.path="$out/random-policy" cluster.num_workers=1 cluster.gpus_per_worker=2 \
    cluster.tensor_parallel=2 rollout.enforce_eager=true
