#!/usr/bin/env bash
# End-to-end RL on the GPU config: SD auto + spot drafter training against SD off, same config and seed,
# then `python -m tlt_rt.compare` (breakdown table, reward and step-time curves overlaid).
# Usage: benchmarks/gpu_rl.sh OUTDIR STEPS [key=value ...]   (the extra keys go to both runs,
#        e.g. drafter.path=DIR for a warmed-up drafter; the off run ignores it)
set -u
out=$1 steps=$2
shift 2
cfg=${TLT_RL_CONFIG:-configs/smollm2-arith-gpu.yaml}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {  # name, then keys
  local name=$1
  shift
  python -m tlt_rt.train "$cfg" name="$name" output_dir="$out/runs" rl.steps="$steps" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? $(grep -c '"step"' "$out/runs/$name/metrics.jsonl" 2>/dev/null || echo 0) steps"
  tail -n 3 "$out/$name.log"
}
run rl-off "$@" rollout.speculative=off drafter.train_online=false
run rl-auto "$@"
python -m tlt_rt.compare "$out/runs/rl-off" "$out/runs/rl-auto" --out "$out"
