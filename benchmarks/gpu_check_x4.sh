#!/usr/bin/env bash
# The GPU tests, both models' drafters, auto against off, the decode step's glue variants and tensor parallelism, on
# one 4-GPU machine (NCCL, NVLink multicast off). Three chains run at once; a job that needs another's output waits
# for its marker file:
#   GPU 0:     the 1.5B checkpoint converted, its drafter warm-up (WARMUP_PROMPTS (3,584) x WARMUP_EPOCHS (1.5),
#              W15_ARGS: more e2e_rl.py arguments, e.g. "--warmup-arg=--unroll=5"),
#              then auto against off per batch on that drafter (interleaved, T=1.0, both rows with a lone prompt's
#              prefill captured up to PREFILL_GRAPHS (256) tokens; AUTO_OFF=0 leaves it out) and a profile of its
#              prefill at batch 1 and 8, eager and captured (`prefill_cost.py`);
#   GPU 1:     the 0.5B warm-up (WARMUP_PROMPTS05 (6,144) x WARMUP_EPOCHS05 (1.5), W05_ARGS: more e2e_rl.py
#              arguments; its peak rate is its config's drafter.warmup_lr), then auto against off on it;
#   GPUs 2-3:  the `gpu` tests in two halves (GPU 3: the engine, drafter, IR and real-Qwen tests; GPU 2: every
#              other test but the two-GPU TP test) and, beside them on the same two GPUs, the TP test (it checks
#              tokens, not times); with GLUE=1 then both checkpoints' decode steps under each glue variant side by
#              side (`step_costs.py --compare`, GPU 3); then TP=2 against TP=1 on the Qwen2.5-7B shape (bf16,
#              graphs, plain and 8_4_32 with an 8,192-id random drafter, NCCL and the one-shot sum, each row's bare
#              captured step beside it), and, once both timings are done, an RL run of one TP=2 engine on the 1.5B
#              with the warm-up's drafter (TP_RL_STEPS (4) steps; its SD step costs in the step log). TP=0 leaves
#              the TP rows and the RL run out.
#              The tests come first: a pass cut short by the device time then still has them.
#              With HOUSE=DIR (a checkout of an earlier commit: `tools/house_before.sh REV` makes .device-before,
#              which the call carries) GPU 3 then times SmolLM2's SD step against its plain
#              step (`step_ratio.py`, 8_4_32 and 6_2_12 at batch 1 and 32, greedy) from that checkout and from this
#              one in turn, twice each (OUT/house-{before,after}-N.log): a change of the house beside the code it
#              started from, on one GPU.
# Each job is its own process pinned by CUDA_VISIBLE_DEVICES with a quarter of the host's cores. Everything runs in
# the background; the call returns at once.
#
#   benchmarks/gpu_check_x4.sh OUT QWEN15_GGUF QWEN05_GGUF   start it (logs: OUT/*.log, progress: OUT/main.log)
#   benchmarks/gpu_check_x4.sh --snapshot OUT DEST           progress lines, and the small records so far
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q15=${2:?QWEN15_GGUF}; q05=${3:?QWEN05_GGUF}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
share_cores 4
cfg1=configs/qwen2.5-1.5b-math-gpu.yaml; cfg05=configs/qwen2.5-0.5b-math-gpu.yaml
prompts=${WARMUP_PROMPTS:-3584}; epochs=${WARMUP_EPOCHS:-1.5}; p05=${WARMUP_PROMPTS05:-6144}
e05=${WARMUP_EPOCHS05:-1.5}; w05_args=${W05_ARGS:-}; timings=${AUTO_OFF:-1}; tp=${TP:-1}
tp_steps=${TP_RL_STEPS:-4}; limit=${TESTS_SECONDS:-540}; glue=${GLUE:-0}; pg=${PREFILL_GRAPHS:-256}
house=${HOUSE:-}; here=$PWD
# an absolute path: the ratios run from inside each checkout, where a relative one would name nothing
if [ -n "$house" ]; then house=$(cd "$house" && pwd) || exit 2; fi
VARIANTS=("--warmup-arg=--gen-batch=512${W15_ARGS:+ $W15_ARGS}")
GLUES="base fused-norm rope-attn fused fused+skinny"

# wait_for NAME: until $out/NAME.done exists
wait_for() { while [ ! -f "$out/$1.done" ]; do sleep 2; done; }
# done_at NAME WHAT: the marker, and a progress line
done_at() { touch "$out/$1.done"; echo "$2 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"; }

# glue_costs GPU MODEL NAME: MODEL's decode step under every glue variant, side by side, into $out/NAME.{log,jsonl}
glue_costs() {
  # shellcheck disable=SC2086  # the variant list splits on purpose
  CUDA_VISIBLE_DEVICES=$1 timeout 240 python benchmarks/step_costs.py --model "$2" --batch 1 8 32 --ctx 1024 \
      --verify --compare $GLUES --skinny-min-weight 0 --profile --out "$out/$3.jsonl" > "$out/$3.log" 2>&1
}

main() {
  local t0
  t0=$(date +%s)
  (   # GPU 0
    convert_target
    warmups
    done_at w0 "1.5B warm-up"
    if [ "$timings" = 1 ] && [ -f "$out/w0/drafter/warmup.json" ]; then
      # both rows with a lone prompt's prefill captured (PREFILL_GRAPHS tokens; 0: eager); eager again if that fails
      auto_off_captured 0 "$q15" "$cfg1" "$out/w0/drafter" auto-off-q15 "1 8 32 128"
      done_at a15 "1.5B auto against off"
      # where a prompt's prefill goes at batch 1 and 8 (eager: host-bound on the 1.5B, 30-47 ms at batch 1)
      CUDA_VISIBLE_DEVICES=0 timeout 200 python benchmarks/prefill_cost.py --target "$q15" --batch 1 8 \
          --chunks 16384 --rounds 5 --drafter "$out/w0/drafter" --profile 25 --graph-tokens 256 \
          --out "$out/prefill-q15.jsonl" \
          > "$out/prefill-q15.log" 2>&1
      done_at prefill "1.5B prefill profile"
    fi
    touch "$out/gpu0.done"
  ) &
  (   # GPU 1
    # shellcheck disable=SC2086  # the variant's arguments split on purpose
    warm_up 1 "$cfg05" "$q05" "$p05" "$e05" "$out/w05" $w05_args
    done_at w05 "0.5B warm-up ($w05_args)"
    if [ "$timings" = 1 ] && [ -f "$out/w05/drafter/warmup.json" ]; then
      auto_off_captured 1 "$q05" "$cfg05" "$out/w05/drafter" auto-off-q05 "1 8 32 128"
      done_at a05 "0.5B auto against off"
    fi
    touch "$out/gpu1.done"
  ) &
  (   # GPUs 2-3
    (
      test_half 3 0
      done_at tests0 "tests on GPU 3 ($(tail -n 1 "$out/tests0.log"))"
      if [ -n "$house" ]; then
        house_ratios 3
        done_at house "step ratios before / after ($house)"
      fi
      if [ "$glue" = 1 ]; then
        glue_costs 3 "$q15" glue-q15
        glue_costs 3 "$q05" glue-q05
        done_at glue "glue variants"
      fi
    ) &
    (
      test_half 2 1
      done_at tests1 "tests on GPU 2 ($(tail -n 1 "$out/tests1.log"))"
    ) &
    tp_test 2,3 400
    done_at tp_test "TP test ($(tail -n 1 "$out/tests_tp.log"))"
    wait
    if [ "$tp" = 1 ]; then
      tp_rows 2,3
      done_at tp2 "TP=2 throughput"
      # after both auto / off timings: the RL run's processes (Ray, the learner's compile workers) took the host's
      # cores from the timings' eager prefills when they overlapped (the 1.5B's one-prompt prefill 44-47 ms
      # against 30 ms the pass before)
      wait_for gpu0
      wait_for gpu1
      tp_rl 2,3
      done_at tp_rl "TP=2 RL run"
    fi
  ) &
  wait
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warmups warmup_ratio convert_target warm_up auto_off auto_off_captured wait_for done_at test_half tp_test glue_costs house_ratios tp_rows tp_rl); $(declare -p VARIANTS DEFAULT GLUES out q15 q05 cfg1 cfg05 prompts epochs p05 e05 w05_args timings tp tp_steps limit glue pg HALF0 HALF1 house here); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_check_x4.sh --snapshot $out DEST"
