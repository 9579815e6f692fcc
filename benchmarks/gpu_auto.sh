#!/usr/bin/env bash
# GPU pass for the adaptive policy: auto against SD off (and fixed strategies) on SmolLM2 bf16, greedy, with
# a warmed-up drafter and with a fresh one, every engine capturing and profiling its graphs first.
# Usage: benchmarks/gpu_auto.sh OUTDIR STAGE...   stages: tests, warmup, trained, fresh, profile
#   DRAFTER (default OUTDIR/drafter), PROMPTS (512) x SAMPLES (4) warm-up answers, BATCHES (1 8 32 128).
set -u
out=$1; shift
drafter=${DRAFTER:-$out/drafter}
batches=${BATCHES:-1 8 32 128}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m tlt_rt.models.default > "$out/model.log" 2>&1
for stage in "$@"; do
  case $stage in
    tests)
      timeout "${TEST_SECS:-200}" python -m pytest -q -p no:cacheprovider -m gpu tests > "$out/gpu_tests.log" 2>&1
      echo "gpu tests (rc=$?): $(tail -1 "$out/gpu_tests.log")"
      grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head -8 ;;
    warmup)
      timeout "${WARMUP_SECS:-240}" python -m tlt_rt.train.drafter.warmup --out "$drafter" --prompts "${PROMPTS:-512}" \
          --samples "${SAMPLES:-4}" --held-out 32 --max-new-tokens 256 --temperature 1.0 --eval-temperatures 0 \
          --strategy 8_4_48 --epochs 5 > "$out/warmup.log" 2>&1
      echo "warm-up rc=$?"; grep -v "drafter warm-up" "$out/warmup.log" | tail -n 4 ;;
    trained|fresh)
      extra=(); [ "$stage" = trained ] && extra=(--drafter "$drafter")
      [ "$stage" = fresh ] && extra=(--configs off auto)
      # shellcheck disable=SC2086
      timeout "${ENGINE_SECS:-300}" python benchmarks/engine_throughput.py --batch $batches --max-new-tokens 128 \
          --strategies 8_4_32 6_2_12 --hf-prompts 0 --repeats "${REPEATS:-5}" --interleave "${extra[@]}" --out "$out/engine-$stage.jsonl" \
          > "$out/engine-$stage.log" 2>&1
      echo "engine_throughput $stage rc=$?"
      sed -n '/^device:/,$p' "$out/engine-$stage.log" | cut -c1-230 ;;
    profile)  # where one call's host time goes, auto at batch 128 with the warmed-up drafter
      timeout 120 python benchmarks/engine_throughput.py --batch 128 --configs auto --strategies 8_4_32 6_2_12 \
          --drafter "$drafter" --hf-prompts 0 --repeats 1 --profile 20 > "$out/profile.log" 2>&1
      grep -A28 -- "--- profile:" "$out/profile.log" | cut -c1-150 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
