#!/usr/bin/env bash
# The GPU tests at a commit, and with the Qwen GGUFs both models' drafters, auto against off, tensor parallelism
# and an RL run of one TP=2 engine, on one 2-GPU machine (NCCL, NVLink multicast off), in three phases:
#   phase 1  GPU 0: the engine, drafter, IR and real-Qwen `gpu` tests; GPU 1: every other one; beside them on both
#            GPUs the two-GPU TP test (it checks tokens, not times); the 1.5B checkpoint converted on the host
#            meanwhile. The tests come first: a pass cut short by the device time then still has them.
#   phase 2  GPU 0: the 1.5B drafter's warm-up (WARMUP_PROMPTS (3,584) x WARMUP_EPOCHS (1.5)), auto against off
#            per batch on it (interleaved, T=1.0, both rows with a lone prompt's prefill captured up to
#            PREFILL_GRAPHS (256) tokens, eager again if that fails), then a profile of its prefill at batch 1 and 8;
#            GPU 1: the 0.5B warm-up (WARMUP_PROMPTS05 (6,144) x WARMUP_EPOCHS05 (1.5), W05_ARGS), auto against off
#            on it, then with HOUSE=DIR (a checkout of an earlier commit: `tools/house_before.sh REV`, carried)
#            SmolLM2's SD / plain step ratios (`step_ratio.py`, 8_4_32 and 6_2_12 at batch 1 and 32) from that
#            checkout and from this one in turn, twice each (OUT/house-{before,after}-N.log).
#            Without the GGUFs phase 2 is the house ratios alone, on GPU 0. With W05B_ARGS GPU 0 warms up a second
#            0.5B drafter instead of the 1.5B's (WARMUP_PROMPTS05B x WARMUP_EPOCHS05B, default the first's, W05B_ARGS)
#            and times it against off: two variants of the small drafter side by side, on one model's answers.
#   phase 3  GPUs 0-1: TP=2 against TP=1 on the Qwen2.5-7B shape (bf16, graphs, plain and 8_4_32 with an 8,192-id
#            random drafter, NCCL and the one-shot sum), then with the GGUFs an RL run of one TP=2 engine on the
#            1.5B with the warm-up's drafter (TP_RL_STEPS (4) steps; without a 1.5B warm-up a fresh drafter that
#            trains online, the policy pricing its SD steps in plain ones all the same). TP=0 leaves phase 3 out.
# Each job is its own process pinned by CUDA_VISIBLE_DEVICES with half the host's cores. Everything runs in the
# background; the call returns at once.
#
#   benchmarks/gpu_check_x2.sh OUT [QWEN15_GGUF QWEN05_GGUF]  start it (logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_check_x2.sh --snapshot OUT DEST            progress lines, and the small records so far
# Settings: TESTS_SECONDS (420, each half), TESTS (1; 0 leaves phase 1's tests out, for code whose GPU tests already
# passed), TP (1), TP_ROWS (1; 0: phase 3 is the RL run alone), AUTO_OFF (1), HOUSE, W05B_ARGS, W15_ARGS (more
# e2e_rl.py arguments of the 1.5B warm-up, e.g. "--warmup-arg=--unroll=5"), and the ones named above.
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q15=${2:-}; q05=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
share_cores 2
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml; cfg05=configs/qwen2.5-0.5b-math-gpu.yaml
prompts=${WARMUP_PROMPTS:-3584}; epochs=${WARMUP_EPOCHS:-1.5}; p05=${WARMUP_PROMPTS05:-6144}
e05=${WARMUP_EPOCHS05:-1.5}; w05_args=${W05_ARGS:-}; timings=${AUTO_OFF:-1}; tp=${TP:-1}
w05b=${W05B_ARGS:-}; p05b=${WARMUP_PROMPTS05B:-$p05}; e05b=${WARMUP_EPOCHS05B:-$e05}
tp_steps=${TP_RL_STEPS:-4}; limit=${TESTS_SECONDS:-420}; tests=${TESTS:-1}; pg=${PREFILL_GRAPHS:-256}; house=${HOUSE:-}; here=$PWD
# an absolute path: the ratios run from inside each checkout, where a relative one would name nothing
if [ -n "$house" ]; then house=$(cd "$house" && pwd) || exit 2; fi
VARIANTS=("--warmup-arg=--gen-batch=512${W15_ARGS:+ $W15_ARGS}")

# done_at WHAT: a progress line
done_at() { echo "$1 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"; }

# timed GPU MODEL CONFIG WARMUP NAME: auto against off on the warm-up WARMUP's drafter, into $out/NAME.*
timed() {
  [ "$timings" = 1 ] && [ -f "$out/$4/drafter/warmup.json" ] || return 0
  auto_off_captured "$1" "$2" "$3" "$out/$4/drafter" "$5" "1 8 32 128"
  done_at "auto against off ($5)"
}

main() {
  local t0
  t0=$(date +%s)
  # phase 1
  if [ "$tests" = 1 ]; then
    ( test_half 0 0; done_at "tests on GPU 0 ($(tail -n 1 "$out/tests0.log"))" ) &
    ( test_half 1 1; done_at "tests on GPU 1 ($(tail -n 1 "$out/tests1.log"))" ) &
    ( tp_test 0,1 500; done_at "TP test ($(tail -n 1 "$out/tests_tp.log"))" ) &
  fi
  if [ -n "$q15" ]; then convert_target; fi
  wait
  # phase 2
  if [ -n "$q15" ]; then
    if [ -n "$w05b" ]; then
      (
        # shellcheck disable=SC2086  # the variant's arguments split on purpose
        warm_up 0 "$cfg05" "$q05" "$p05b" "$e05b" "$out/w05b" $w05_args $w05b
        done_at "second 0.5B warm-up ($w05_args $w05b)"
        timed 0 "$q05" "$cfg05" w05b auto-off-q05b
      ) &
    else
      (
        warmups
        done_at "1.5B warm-up"
        timed 0 "$q15" "$cfg1" w0 auto-off-q15
        if [ -f "$out/w0/drafter/warmup.json" ]; then
          CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/prefill_cost.py --target "$q15" --batch 1 8 \
              --chunks 16384 --rounds 5 --drafter "$out/w0/drafter" --profile 25 --graph-tokens 256 \
              --out "$out/prefill-q15.jsonl" > "$out/prefill-q15.log" 2>&1
          done_at "1.5B prefill profile"
        fi
      ) &
    fi
    (
      # shellcheck disable=SC2086  # the variant's arguments split on purpose
      warm_up 1 "$cfg05" "$q05" "$p05" "$e05" "$out/w05" $w05_args
      done_at "0.5B warm-up ($w05_args)"
      timed 1 "$q05" "$cfg05" w05 auto-off-q05
      if [ -n "$house" ]; then house_ratios 1 && done_at "step ratios before / after ($house)"; fi
    ) &
    wait
  elif [ -n "$house" ]; then
    house_ratios 0 && done_at "step ratios before / after ($house)"
  fi
  # phase 3
  if [ "$tp" = 1 ]; then
    if [ "${TP_ROWS:-1}" = 1 ]; then
      tp_rows 0,1
      done_at "TP=2 throughput"
    fi
    if [ -n "$q15" ]; then
      tp_rl 0,1
      done_at "TP=2 RL run"
    fi
  fi
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warmups convert_target warm_up auto_off auto_off_captured timed done_at test_half tp_test house_ratios tp_rows tp_rl); $(declare -p VARIANTS DEFAULT out q15 q05 cfg1 cfg05 prompts epochs p05 e05 w05_args w05b p05b e05b timings tp tp_steps limit tests pg HALF0 HALF1 house here); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_check_x2.sh --snapshot $out DEST"
