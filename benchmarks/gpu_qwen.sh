#!/usr/bin/env bash
# The real-model pass on one GPU, in the order that fits one session's device time:
#   1. the learner and both phases' memory on random weights of the model's shape (benchmarks/learner_step.py),
#   2. every `gpu` test (Qwen's shape and, with TLT_QWEN_GGUF, the real checkpoint's greedy identity),
#   3. the end-to-end RL figure on the Qwen config, started in the background (its log: OUT/e2e.log).
# Usage: benchmarks/gpu_qwen.sh OUT CONFIG E2E_SECONDS [KEY=VALUE ...]   (model.path=... among the keys)
# Then poll with `benchmarks/gpu_qwen.sh --snapshot OUT DEST`: the e2e log's tail, and the small records so far
# packed into DEST/snapshot.tgz (what a lost call would otherwise take with it).
set -u
if [ "${1:-}" = "--snapshot" ]; then
  out=${2:?OUT}; dest=${3:?DEST}
  tail -6 "$out/e2e.log" 2>/dev/null
  (cd "$out" && find . -maxdepth 4 \( -name '*.log' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' \
      -o -name 'warmup.json' \) -size -4M -print0 | tar czf "$dest/snapshot.tgz" --null -T -)
  exit 0
fi
out=${1:?OUT}; config=${2:?CONFIG}; budget=${3:?E2E_SECONDS}; shift 3
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
if [ "${LEARNER_STEP:-1}" = 1 ]; then  # LEARNER_STEP=0: measured in an earlier call of this session
  timeout 240 python benchmarks/learner_step.py --config "$config" --shape "${SHAPE:-qwen2.5-coder-1.5b}" \
      --variants "" "rl.activation_checkpointing=false rl.micro_batch_tokens=8192" --out "$out/learner_step.jsonl" \
      > "$out/learner_step.log" 2>&1
  echo "learner_step ($(( $(date +%s) - t0 )) s):"; tail -5 "$out/learner_step.log"
fi
[ -n "${TLT_QWEN_GGUF:-}" ] && python -c "import sys; from tlt_rt.models.default import convert_gguf; print(convert_gguf(sys.argv[1]))" \
    "$TLT_QWEN_GGUF" > "$out/convert.log" 2>&1  # once, outside the tests' time limit
echo "converted ($(( $(date +%s) - t0 )) s): $(tail -1 "$out/convert.log")"
timeout 330 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
echo "gpu tests ($(( $(date +%s) - t0 )) s): $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -8
setsid nohup python benchmarks/e2e_rl.py --config "$config" --steps "${E2E_STEPS:-30}" --time-limit "$budget" --out "$out/e2e" \
    --warmup-prompts "${WARMUP_PROMPTS:-64}" --warmup-max-new-tokens 512 --warmup-epochs 4 --warmup-curve 3 \
    -- "$@" > "$out/e2e.log" 2>&1 < /dev/null &
echo "e2e started (pid $!), budget ${budget}s"
