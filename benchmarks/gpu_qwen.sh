#!/usr/bin/env bash
# The real-model pass on one GPU: every `gpu` test (Qwen's shape and, with TLT_QWEN_GGUF, the real checkpoint's
# greedy identity), the learner's log-prob head against the dense one, then the end-to-end RL figure on the Qwen
# config in the background (its log in OUT/e2e.log; poll it with `tail`).
# Usage: benchmarks/gpu_qwen.sh OUT CONFIG E2E_SECONDS [KEY=VALUE ...]   (model.path=... among the keys)
set -u
out=${1:?OUT}; config=${2:?CONFIG}; budget=${3:?E2E_SECONDS}; shift 3
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
[ -n "${TLT_QWEN_GGUF:-}" ] && python -c "import sys; from tlt_rt.models.default import convert_gguf; print(convert_gguf(sys.argv[1]))" \
    "$TLT_QWEN_GGUF" > "$out/convert.log" 2>&1  # once, outside the tests' time limit
echo "converted ($(( $(date +%s) - t0 )) s): $(tail -1 "$out/convert.log")"
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
echo "gpu tests ($(( $(date +%s) - t0 )) s): $(tail -1 "$out/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -8
timeout 120 python benchmarks/bench_logprobs.py > "$out/logprobs.log" 2>&1
tail -12 "$out/logprobs.log"
setsid nohup python benchmarks/e2e_rl.py --config "$config" --steps 30 --time-limit "$budget" --out "$out/e2e" \
    --warmup-prompts 192 --warmup-max-new-tokens 512 --warmup-epochs 6 -- "$@" > "$out/e2e.log" 2>&1 < /dev/null &
echo "e2e started (pid $!), budget ${budget}s"
