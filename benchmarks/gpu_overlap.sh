#!/usr/bin/env bash
# Steps queued one ahead of the host (rollout.overlap, rollout.overlap_speculative) on one 2-GPU machine (NCCL,
# NVLink multicast off), in two calls of the device tool, each well inside its 10 minutes:
#   benchmarks/gpu_overlap.sh tests OUT [Q05_GGUF]    every `gpu` test: the engine / drafter / IR / real-Qwen half
#                                                     on GPU 0 beside the other half on GPU 1, the two-GPU TP tests
#                                                     beside them on both (~450 s; logs OUT/tests{0,1}.log,
#                                                     OUT/tp_{graphs,fused}.log)
#   benchmarks/gpu_overlap.sh measure OUT Q05_GGUF    GPU 0: Qwen2.5-Coder-0.5B at T=1.0, off / off-serial and, with
#                                                     one strategy and speculative steps queued ahead, auto /
#                                                     auto-serial, interleaved (OUT/overlap-q05.log); then GPUs 0-1:
#                                                     the 7B shape at TP=2 against TP=1, plain steps queued ahead and
#                                                     one at a time, 8_4_32 queued ahead (batch 1), every engine
#                                                     kept and timed in TP_ROUNDS (3) interleaved rounds, one
#                                                     process a batch size (OUT/overlap-tp2-7b-b{1,32}.log)
#   benchmarks/gpu_overlap.sh trained OUT Q05_GGUF    one GPU: a short drafter warm-up on the 0.5B's RL task (its
#                                                     accept and perfect-drafter ceiling in W05/drafter/warmup.json;
#                                                     W05 is OUT/w05 unless set), then auto over the default
#                                                     strategies against off with that drafter, interleaved, T=1.0
#                                                     (OUT/auto-off-q05.log): auto / off with every step queued
#                                                     ahead. A warm-up already in W05 is used as it is, so the two
#                                                     fit two calls of the device tool:
#   benchmarks/gpu_overlap.sh warm OUT Q05_GGUF       the warm-up alone (W05=/tmp/w05 keeps it on the machine for
#                                                     a `trained` call right after: ~400 s, then ~360 s)
# Settings: TESTS_SECONDS (480), Q05_SECONDS (300), TP_SECONDS (200 a batch size), STRATEGY (8_4_32), BATCHES ("1 32 128": each
# batch builds and captures its engines anew, the auto ones every bucket up to it); warm / trained: W05,
# WARMUP_PROMPTS (1024), WARMUP_EPOCHS (1), WARMUP_SECONDS (420: one H200 took 391 s for twice the answers, 236 s
# of it measuring), AUTO_SECONDS (360).
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
what=${1:?tests or measure}; out=${2:?OUT}; q05=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -n "$q05" ] && export TLT_QWEN_GGUF=$q05
strategy=${STRATEGY:-8_4_32}
case "$what" in
  tests)
    share_cores 2
    limit=${TESTS_SECONDS:-480}
    test_half 0 0 &
    test_half 1 1 &
    for k in graphs fused; do
      CUDA_VISIBLE_DEVICES=0,1 timeout "$limit" python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_tp_gpu.py \
          -k "$k" > "$out/tp_$k.log" 2>&1 &
    done
    wait
    tail -n 4 "$out"/tests0.log "$out"/tests1.log "$out"/tp_graphs.log "$out"/tp_fused.log
    ;;
  measure)
    [ -n "$q05" ] || { echo "measure needs the Qwen2.5-Coder-0.5B GGUF" >&2; exit 2; }
    # shellcheck disable=SC2086  # the batch list splits on purpose
    CUDA_VISIBLE_DEVICES=0 timeout "${Q05_SECONDS:-300}" python benchmarks/engine_throughput.py --target "$q05" --temperature 1 \
        --task-config configs/qwen2.5-0.5b-math-gpu.yaml --configs off off-serial auto auto-serial \
        --strategies "$strategy" --overlap-speculative --interleave --batch ${BATCHES:-1 32 128} --max-new-tokens 256 \
        > "$out/overlap-q05.log" 2>&1
    # one process a batch size (both in one, 5 rounds, did not finish in 330 s); the SD step at batch 1 only
    for b in 1 32; do
      sd=(); [ "$b" = 1 ] && sd=(--sd "$strategy" --overlap-speculative)
      CUDA_VISIBLE_DEVICES=0,1 timeout "${TP_SECONDS:-200}" python benchmarks/tp_throughput.py --shape qwen2.5-7b \
          --tp 2 --batch "$b" --max-new-tokens 128 --allreduce oneshot --overlap on off "${sd[@]}" \
          --rounds "${TP_ROUNDS:-3}" > "$out/overlap-tp2-7b-b$b.log" 2>&1
    done
    grep -E "^(tlt|provider) " "$out/overlap-q05.log" || true
    grep -hE "^\| " "$out"/overlap-tp2-7b-b*.log || true
    ;;
  warm|trained)
    [ -n "$q05" ] || { echo "$what needs the Qwen2.5-Coder-0.5B GGUF" >&2; exit 2; }
    cfg=configs/qwen2.5-0.5b-math-gpu.yaml
    w05=${W05:-$out/w05}
    if [ ! -f "$w05/drafter/warmup.json" ]; then
      mkdir -p "$(dirname "$w05")"
      timeout "${WARMUP_SECONDS:-420}" bash -c "source benchmarks/gpu_pass_lib.sh; out='$out'; warm_up 0 $cfg '$q05' \
          ${WARMUP_PROMPTS:-1024} ${WARMUP_EPOCHS:-1} '$w05'"
      cp "$w05.log" "$out/" 2>/dev/null || true
    fi
    echo "warm-up: accept / ceiling x1000 = $(warmup_ratio "$w05")"
    [ "$what" = warm ] && exit 0
    [ -f "$w05/drafter/warmup.json" ] || { echo "no drafter in $w05: the warm-up did not finish" >&2; exit 1; }
    # shellcheck disable=SC2086  # the strategy list splits on purpose
    timeout "${AUTO_SECONDS:-360}" bash -c "source benchmarks/gpu_pass_lib.sh; out='$out'; auto_off 0 '$q05' $cfg \
        '$w05/drafter' auto-off-q05 '${BATCHES:-1 32 128}' --configs off auto --strategies $DEFAULT"
    grep -E "^(tlt|provider) " "$out/auto-off-q05.log" || true
    ;;
  *)
    echo "usage: $0 tests|measure|warm|trained OUT [Q05_GGUF]" >&2
    exit 2
    ;;
esac
