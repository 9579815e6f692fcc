# Shell functions the GPU passes share (benchmarks/gpu_one.sh, gpu_x2.sh, gpu_x4.sh, gpu_check_x2.sh, gpu_check_x4.sh
# and gpu_drafter_*.sh source this file). They read the caller's globals: out (the pass folder), q15 (the Qwen 1.5B
# GGUF), cfg1 (the one-GPU config), prompts (warm-up prompts), the array VARIANTS (one warm-up per entry, entry i on
# GPU i) and, where set, epochs, curve and max_new (the warm-ups' passes, curve points and answer length; 4, 3 and
# WARMUP_MAX_NEW or 512), pg (captured prefill tokens), house and here (the checkouts compared), tp_steps.

# a share of the host's cores for each of $1 jobs at once (OMP_NUM_THREADS, unless already set): jobs that each
# used every core slowed each other's host work (drafter training 6x slower with three warm-ups at once)
share_cores() {
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / $1 > 0 ? $(nproc) / $1 : 1 ))}
  export OMP_NUM_THREADS
}

# the `gpu` tests in two halves, one GPU each (gpu_check_x2.sh, gpu_check_x4.sh): the engine, drafter and IR tests
# with the real-Qwen ones (on an H200 beside the TP tests, 2026-11-28: the first three files 275 s, the real-Qwen
# file 107 s alone); every other one (the kernels', the log-probs', the models') but the two-GPU TP test, which runs
# on both GPUs (with the real-Qwen file that half was cut at 490 s in its last test). Each log lists its ten slowest
# tests, to even the halves out.
HALF0="tests/test_engine_gpu.py tests/test_drafter_train.py tests/test_ir_tree.py tests/test_qwen_gpu.py"
HALF1="tests --ignore=tests/test_engine_gpu.py --ignore=tests/test_drafter_train.py --ignore=tests/test_ir_tree.py
--ignore=tests/test_qwen_gpu.py --ignore=tests/test_tp_gpu.py"

# test_half GPU N: half N of the `gpu` tests on GPU, cut at $limit seconds, into $out/testsN.log
test_half() {
  local half=HALF$2
  # shellcheck disable=SC2086  # the file list splits on purpose
  CUDA_VISIBLE_DEVICES=$1 timeout "$limit" python -m pytest -q -p no:cacheprovider --durations=10 -m gpu ${!half} > "$out/tests$2.log" 2>&1
}

# tp_test GPUS SECONDS: the two-GPU tensor-parallel test on GPUS (it checks tokens, not times), cut at SECONDS, into
# $out/tests_tp.log
tp_test() {
  CUDA_VISIBLE_DEVICES=$1 timeout "$2" python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_tp_gpu.py \
      > "$out/tests_tp.log" 2>&1
}

# the engine's default strategy set (rollout.config.DEFAULT_STRATEGIES), which every auto-against-off timing gives auto
DEFAULT="8_4_48 8_4_32 8_4_16 8_4_8 6_2_12"

# warm_up GPU CONFIG MODEL PROMPTS EPOCHS DIR [more e2e_rl.py arguments]: one drafter warm-up on CONFIG's task into
# DIR/drafter (log DIR.log): answers cut at 512 tokens and generated 512 at a time, every default strategy measured
# at the end
warm_up() {
  local gpu=$1 cfg=$2 model=$3 n=$4 passes=$5 dir=$6
  shift 6
  CUDA_VISIBLE_DEVICES=$gpu python benchmarks/e2e_rl.py --config "$cfg" --out "$dir" --warmup-only \
      --warmup-prompts "$n" --warmup-epochs "$passes" --warmup-max-new-tokens 512 --warmup-curve 3 \
      --warmup-arg=--also-strategies=default --warmup-arg=--gen-batch=512 "$@" -- "model.path=$model" > "$dir.log" 2>&1
}

# warmup_ratio DIR: the warm-up's accept / ceiling x1000 at the RL temperature (DIR/drafter/warmup.json), -1 when
# it did not finish
warmup_ratio() {
  python - "$1/drafter/warmup.json" <<'PY'
import json, sys
try:
    rep = json.load(open(sys.argv[1]))
    acc = next(iter(rep["accept_length"].values()))  # the RL temperature's (keyed as the warm-up wrote it: "1")
    print(int(1000 * acc["after"] / acc["ceiling"]))
except Exception:
    print(-1)
PY
}

# auto_off GPU MODEL CONFIG DRAFTER NAME BATCHES [more engine_throughput.py arguments: the configurations]: the
# configurations in interleaved rounds at T=1.0 on CONFIG's task, into $out/NAME.jsonl and $out/NAME.log
auto_off() {
  local gpu=$1 model=$2 cfg=$3 drafter=$4 name=$5 batches=$6
  shift 6
  # shellcheck disable=SC2086  # the batch sizes split on purpose
  CUDA_VISIBLE_DEVICES=$gpu python benchmarks/engine_throughput.py --target "$model" --temperature 1 \
      --task-config "$cfg" --drafter "$drafter" --interleave --learn-rounds 1 --repeats 3 --max-new-tokens 384 \
      --batch $batches --hf-prompts 0 --out "$out/$name.jsonl" "$@" > "$out/$name.log" 2>&1
}

# the Qwen GGUF converted to the project's model folder (the caller's t0: the pass's start, for main.log)
convert_target() {
  python -c "import sys; from tlt_rt.models.default import convert_gguf; print(convert_gguf(sys.argv[1]))" "$q15" \
      > "$out/convert.log" 2>&1
  echo "converted at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}

# every VARIANTS warm-up at once, warm-up i on GPU i, into $out/w$i (each drafter also measured with every strategy
# of the engine's default set: warmup.json's accept_by_strategy); returns when all are done
warmups() {
  local i pids=()
  for i in "${!VARIANTS[@]}"; do
    # shellcheck disable=SC2086  # a variant's arguments split on purpose
    CUDA_VISIBLE_DEVICES=$i python benchmarks/e2e_rl.py --config "$cfg1" --out "$out/w$i" --warmup-only \
        --warmup-prompts "$prompts" --warmup-max-new-tokens "${max_new:-${WARMUP_MAX_NEW:-512}}" \
        --warmup-epochs "${epochs:-4}" --warmup-curve "${curve:-3}" --warmup-arg=--also-strategies=default \
        ${VARIANTS[$i]} \
        -- "model.path=$q15" > "$out/warmup$i.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
}

# the index of the warm-up with the highest accept / ceiling at the RL temperature (each written to
# $out/choice.txt), or -1 when none finished
best_warmup() {
  local i ratio best=-1 top=-1
  for i in "${!VARIANTS[@]}"; do
    ratio=$(warmup_ratio "$out/w$i")
    echo "variant $i (${VARIANTS[$i]:-default}): accept/ceiling x1000 = $ratio" >> "$out/choice.txt"
    if [ "$ratio" -gt "$top" ]; then top=$ratio; best=$i; fi
  done
  echo "$best"
}

# a worker killed mid-rollout (SmolLM2, 3 steps, two GPU workers on the GPUs $1), then the check line
kill_run() {
  CUDA_VISIBLE_DEVICES=$1 timeout 420 python -m tlt_rt.train configs/smollm2-tail-gpu.yaml name=kill \
      "output_dir=$out/kill" rl.steps=3 cluster.num_workers=2 cluster.debug_fail=rollout:1:1 \
      rl.checkpoint_every=0 logging.eval_every=0 > "$out/kill.log" 2>&1
  python - "$out/kill/kill" >> "$out/kill.log" 2>&1 <<'PY'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
died = (run / ".debug_fail.rollout.1.1").is_file()
full = [len(r["response_lengths"]) for r in recs]
print(f"kill check: worker 1 died in step 1: {died}; steps {[r['step'] for r in recs]}; answers per step {full}; "
      f"restarts {recs[-1]['worker_restarts'] if recs else None}")
PY
}

# `--snapshot OUT DEST` of every pass: the last lines of each log and the choice made, and the small records so far
# (logs, jsonl, pages, plots, warm-up reports under 4 MB) packed into DEST/snapshot.tgz
snapshot() {
  local out=$1 dest=$2 f
  for f in "$out"/*.log; do [ -f "$f" ] && printf '%s: %s\n' "$(basename "$f")" "$(tail -c 300 "$f" | tail -n 2 | tr '\n' ' ')"; done
  cat "$out/choice.txt" 2>/dev/null
  (cd "$out" && find . -maxdepth 6 \( -name '*.log' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.txt' \
      -o -name 'warmup.json' \) -size -4M -print0 | tar czf "$dest/snapshot.tgz" --null -T -)
}

# auto_off_captured GPU MODEL CONFIG DRAFTER NAME BATCHES: `auto_off` of off against auto over the engine's default
# strategy set, both rows with a lone prompt's prefill captured up to $pg tokens; eagerly again if that run fails
auto_off_captured() {
  # shellcheck disable=SC2086  # the strategy list splits on purpose
  auto_off "$@" --configs off auto --strategies $DEFAULT --prefill-graph-tokens "$pg" ||
    auto_off "$@" --configs off auto --strategies $DEFAULT
}

# house_ratios GPU: SmolLM2's SD / plain step ratios (`step_ratio.py`, 8_4_32 and 6_2_12 at batch 1 and 32) from the
# earlier checkout $house (an absolute path) and from this one ($here) in turn, twice each, on GPU, into
# $out/house-{before,after}-N.log
house_ratios() {
  local n side dir
  for n in 1 2; do
    for side in before after; do
      dir=$here; [ "$side" = before ] && dir=$house
      (cd "$dir" && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH="/tmp/site:$dir" timeout 240 python benchmarks/step_ratio.py \
          --batch 1 32 --strategies 8_4_32 6_2_12 --rounds 3 > "$out/house-$side-$n.log" 2>&1)
    done
  done
}

# tp_rows GPUS: TP=2 against TP=1 on the Qwen2.5-7B shape (bf16, graphs, plain and 8_4_32, NCCL and the one-shot
# sum, profiled) on the two GPUs, into $out/tp2.log and $out/tp_profile
tp_rows() {
  CUDA_VISIBLE_DEVICES=$1 timeout -s USR1 -k 15 300 python benchmarks/tp_throughput.py --shape qwen2.5-7b --tp 2 \
      --batch 1 32 --max-new-tokens 128 --sd 8_4_32 --allreduce nccl oneshot --profile "$out/tp_profile" \
      > "$out/tp2.log" 2>&1
}

# tp_rl GPUS: an RL run of one TP=2 engine on the 1.5B ($q15, $cfg1), $tp_steps steps, on the two GPUs, into $out/tp_rl
# and $out/tp_rl.log: with the 1.5B warm-up's drafter ($out/w0/drafter) where there is one, else with a fresh one
# that trains online. Speculation stays auto: its policy times plain steps first and prices each strategy's step
# in them, the step log's SD step costs (forced on, no plain step is ever timed to price it against)
tp_rl() {
  local drafter=()
  [ -f "$out/w0/drafter/warmup.json" ] && drafter=("drafter.path=$out/w0/drafter")
  TORCHINDUCTOR_COMPILE_THREADS=4 CUDA_VISIBLE_DEVICES=$1 timeout 420 python -m tlt_rt.train "$cfg1" name=tp2 \
      "output_dir=$out/tp_rl" "model.path=$q15" "${drafter[@]}" rl.steps="$tp_steps" \
      cluster.num_workers=1 cluster.gpus_per_worker=2 cluster.tensor_parallel=2 rollout.max_new_tokens=1024 \
      rl.checkpoint_every=0 logging.eval_every=0 > "$out/tp_rl.log" 2>&1
}
