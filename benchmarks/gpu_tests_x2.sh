#!/usr/bin/env bash
# Every `gpu` test at a commit on one 2-GPU machine (NCCL, NVLink multicast off), in the background: the engine,
# drafter, IR and real-Qwen half on GPU 0 beside every other one on GPU 1, then the two-GPU TP test on both.
#   benchmarks/gpu_tests_x2.sh OUT [QWEN05_GGUF]    start it (logs: OUT/tests0.log, tests1.log, tests_tp.log;
#                                                   progress: OUT/main.log)
#   benchmarks/gpu_tests_x2.sh --snapshot OUT DEST  progress lines, and the logs so far in DEST/snapshot.tgz
# Settings: TESTS_SECONDS (420, each half), TP_SECONDS (240).
set -u
# shellcheck source=benchmarks/gpu_pass_lib.sh
source "$(dirname "$0")/gpu_pass_lib.sh"
if [ "${1:-}" = "--snapshot" ]; then
  snapshot "${2:?OUT}" "${3:?DEST}"
  exit 0
fi
out=${1:?OUT}; q05=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -n "$q05" ] && export TLT_QWEN_GGUF=$q05
share_cores 2
limit=${TESTS_SECONDS:-420}

main() {
  local t0
  t0=$(date +%s)
  test_half 0 0 &
  test_half 1 1 &
  wait
  echo "halves done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
  tp_test 0,1 "${TP_SECONDS:-240}"
  echo "TP test done at $(( $(date +%s) - t0 )) s" >> "$out/main.log"
}
main > "$out/driver.log" 2>&1 &
echo "started: $out/main.log"
