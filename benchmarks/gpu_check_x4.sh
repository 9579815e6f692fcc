#!/usr/bin/env bash
# The GPU tests, both models' drafters, auto against off and tensor parallelism, on one 4-GPU machine (NCCL, NVLink
# multicast off). Four chains run at once; a chain that needs another's output waits for its marker file:
#   GPU 0:     the 1.5B checkpoint converted, its drafter warm-up (WARMUP_PROMPTS (3,072) x WARMUP_EPOCHS (1.5)),
#              then auto against off per batch on that drafter (interleaved, T=1.0; AUTO_OFF=0 leaves it out);
#   GPU 1:     the 0.5B warm-up with W05_ARGS (default "--warmup-arg=--unroll=5", WARMUP_PROMPTS05 (5,120) x
#              WARMUP_EPOCHS05 (1.0)), then auto against off on the better of the two 0.5B drafters;
#   GPU 3:     the engine, drafter and IR `gpu` tests, then the 0.5B warm-up as its config sets it (5,120 x 1.3:
#              the comparison for W05_ARGS, on the same machine);
#   GPU 2:     every other `gpu` test but the two-GPU TP test, then the eager phases of a rollout on the 1.5B shape
#              (eager_profile.py), the 1.5B checkpoint's decode step against its HBM floor (step_costs.py --profile)
#              and a sweep of the decode attention's launch parameters on its heads; then, once GPU 3 is free,
#              on GPUs 2-3: the TP test, TP=2 against TP=1 on the Qwen2.5-7B shape (bf16, graphs, plain and 8_4_32,
#              NCCL and the one-shot sum; each row profiled once more into OUT/tp_profile), and an RL run of one
#              TP=2 engine on the 1.5B with the warm-up's drafter (TP_RL_STEPS (4) steps; its SD step costs in the
#              step log). TP=0 leaves the last two out.
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
prompts=${WARMUP_PROMPTS:-3072}; epochs=${WARMUP_EPOCHS:-1.5}; p05=${WARMUP_PROMPTS05:-5120}
e05=${WARMUP_EPOCHS05:-1.0}; w05_args=${W05_ARGS:---warmup-arg=--unroll=5}; timings=${AUTO_OFF:-1}; tp=${TP:-1}
tp_steps=${TP_RL_STEPS:-4}; limit=${TESTS_SECONDS:-330}
VARIANTS=("--warmup-arg=--gen-batch=512")

# wait_for NAME: until $out/NAME.done exists
wait_for() { while [ ! -f "$out/$1.done" ]; do sleep 2; done; }
# done_at NAME WHAT: the marker, and a progress line
done_at() { touch "$out/$1.done"; echo "$2 done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"; }

main() {
  local t0 d05 r05 r05b
  t0=$(date +%s)
  (   # GPU 0
    convert_target
    warmups
    done_at w0 "1.5B warm-up"
    if [ "$timings" = 1 ] && [ -f "$out/w0/drafter/warmup.json" ]; then
      # shellcheck disable=SC2086  # the strategy list splits on purpose
      auto_off 0 "$q15" "$cfg1" "$out/w0/drafter" auto-off-q15 "1 8 32 128" --configs off auto --strategies $DEFAULT
      done_at a15 "1.5B auto against off"
    fi
  ) &
  (   # GPU 1
    # shellcheck disable=SC2086  # the variant's arguments split on purpose
    warm_up 1 "$cfg05" "$q05" "$p05" "$e05" "$out/w05b" $w05_args
    done_at w05b "0.5B warm-up ($w05_args)"
    wait_for w05
    d05=$out/w05; r05=$(warmup_ratio "$out/w05"); r05b=$(warmup_ratio "$out/w05b")
    if [ "$r05b" -gt "$r05" ]; then d05=$out/w05b; fi
    echo "0.5B: w05 $r05, w05b $r05b x1000: $d05" >> "$out/choice.txt"
    if [ "$timings" = 1 ] && [ -f "$d05/drafter/warmup.json" ]; then
      # shellcheck disable=SC2086
      auto_off 1 "$q05" "$cfg05" "$d05/drafter" auto-off-q05 "1 8 32 128" --configs off auto --strategies $DEFAULT
      done_at a05 "0.5B auto against off"
    fi
  ) &
  (   # GPU 3
    test_half 3 0
    done_at tests0 "tests on GPU 3 ($(tail -n 1 "$out/tests0.log"))"
    warm_up 3 "$cfg05" "$q05" "$p05" 1.3 "$out/w05"
    done_at w05 "0.5B warm-up (its config's)"
  ) &
  (   # GPU 2, then GPUs 2-3
    test_half 2 1
    done_at tests1 "tests on GPU 2 ($(tail -n 1 "$out/tests1.log"))"
    CUDA_VISIBLE_DEVICES=2 timeout 200 python benchmarks/eager_profile.py --model qwen2.5-coder-1.5b --batch 128 \
        --prompt-len 96 --plain-steps 80 --out "$out/eager" > "$out/eager.log" 2>&1
    done_at eager "eager profile"
    CUDA_VISIBLE_DEVICES=2 timeout 150 python benchmarks/step_costs.py --model "$q15" --batch 1 8 32 --ctx 1024 \
        --verify 16 48 --profile --out "$out/step_costs.jsonl" > "$out/step_costs.log" 2>&1
    CUDA_VISIBLE_DEVICES=2 timeout 120 python benchmarks/bench_attention.py --tune --shape qwen2.5-coder-1.5b \
        --decode 1x1024 32x1024 --best-out "$out/attention_best.json" > "$out/attention_tune.log" 2>&1
    done_at gpu2 "step costs and the attention sweep"
    wait_for w05
    CUDA_VISIBLE_DEVICES=2,3 timeout 600 python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_tp_gpu.py \
        > "$out/tests_tp.log" 2>&1
    done_at tp_test "TP test ($(tail -n 1 "$out/tests_tp.log"))"
    if [ "$tp" = 1 ]; then
      CUDA_VISIBLE_DEVICES=2,3 timeout -s USR1 -k 15 300 python benchmarks/tp_throughput.py --shape qwen2.5-7b --tp 2 \
          --batch 1 32 --max-new-tokens 128 --sd 8_4_32 --allreduce nccl oneshot --profile "$out/tp_profile" \
          > "$out/tp2.log" 2>&1
      done_at tp2 "TP=2 throughput"
      wait_for w0
      CUDA_VISIBLE_DEVICES=2,3 timeout 420 python -m tlt_rt.train "$cfg1" name=tp2 "output_dir=$out/tp_rl" \
          "model.path=$q15" "drafter.path=$out/w0/drafter" rl.steps="$tp_steps" cluster.num_workers=1 \
          cluster.gpus_per_worker=2 cluster.tensor_parallel=2 rollout.max_new_tokens=1024 rl.checkpoint_every=0 \
          logging.eval_every=0 > "$out/tp_rl.log" 2>&1
      done_at tp_rl "TP=2 RL run"
    fi
  ) &
  wait
  echo "all done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

setsid nohup bash -c "$(declare -f main warmups warmup_ratio convert_target warm_up auto_off wait_for done_at test_half); $(declare -p VARIANTS DEFAULT out q15 q05 cfg1 cfg05 prompts epochs p05 e05 w05_args timings tp tp_steps limit HALF0 HALF1); main" \
    > "$out/main.log" 2>&1 < /dev/null &
echo "started (pid $!); poll with: benchmarks/gpu_check_x4.sh --snapshot $out DEST"
