#!/usr/bin/env bash
# What a speculative step costs on one GPU, and what a drafter trainer beside the rollout takes from it, in
# the parts a call has time for (SmolLM2 bf16, the GPU configs' 8,192-id draft head):
#   tests    every `gpu` test (~3 minutes on an H100)
#   ratio    SD step / plain step, one engine, interleaved, batch 1 and 32, 8_4_32 and 6_2_12, with each
#            step's kernels (~2 minutes)
#   trainer  plain and 6_2_12 steps at batch 4 and 8 (where the rollout's tail spends its time) beside the RL
#            worker's drafter trainer, by its SM share, pacing, switch interval and batch (shorter kernels), and
#            beside a pure-Python thread (what the GIL alone costs) (~3 minutes)
#   phases   the step's kernels by phase, batch 1 and 32 (~1.5 minutes)
#   vocab    the same at batch 1 and 32 for 8_4_32 with draft heads of 2,048, 4,096 and 16,384 ids and the full
#            one: a draft level's cost against the vocabulary's size (~3 minutes)
# Usage: [COMMIT=abc1234] benchmarks/gpu_steps.sh OUTDIR [PART ...]  (default: ratio trainer; each part has its own timeout)
set -u
out=${1:-gpu-results}
shift || true
parts=${*:-ratio trainer}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # the device copy may have no .git: COMMIT=...
python -m tlt_rt.models.default > "$out/model.log" 2>&1
for part in $parts; do
  case $part in
    tests)
      timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu-tests-$commit.log" 2>&1
      echo "gpu tests at $commit: $(tail -1 "$out/gpu-tests-$commit.log")"
      grep -E "^(FAILED|ERROR)" "$out/gpu-tests-$commit.log" | head -8 ;;
    ratio)
      timeout 240 python benchmarks/step_ratio.py --batch 1 32 --strategies 8_4_32 6_2_12 --rounds 3 \
          --max-new-tokens 64 --kernels 0 --draft-vocab 8192 --out "$out/step-ratio-$commit.jsonl" \
          > "$out/step-ratio-$commit.log" 2>&1
      tail -n 6 "$out/step-ratio-$commit.log" ;;
    trainer)
      timeout 330 python benchmarks/step_ratio.py --batch 4 8 --strategies 6_2_12 --rounds 3 --max-new-tokens 96 \
          --hidden --draft-vocab 8192 --trainer sms=16,vocab=8192 sms=16,vocab=8192,gil=0 py sms=8,vocab=8192 \
          sms=16,vocab=8192,duty=0.5 sms=16,vocab=8192,tokens=1024 --out "$out/trainer-beside-$commit.jsonl" > "$out/trainer-beside-$commit.log" 2>&1
      tail -n 14 "$out/trainer-beside-$commit.log" ;;
    phases)
      timeout 200 python benchmarks/step_phases.py --batch 1 32 --strategies 8_4_32 6_2_12 --draft-vocab 8192 \
          --show 3 --out "$out/step-phases-$commit.jsonl" > "$out/step-phases-$commit.log" 2>&1
      tail -n 7 "$out/step-phases-$commit.log" ;;
    vocab)
      for n in 2048 4096 16384 0; do
        timeout 100 python benchmarks/step_phases.py --batch 1 32 --strategies 8_4_32 --draft-vocab $n --show 0 \
            --out "$out/step-phases-vocab-$commit.jsonl" > "$out/step-phases-vocab$n-$commit.log" 2>&1
        echo "draft vocabulary $n:"; tail -n 3 "$out/step-phases-vocab$n-$commit.log"
      done ;;
    *) echo "unknown part: $part (tests, ratio, trainer, phases, vocab)" >&2; exit 2 ;;
  esac
done
