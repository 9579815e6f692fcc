"""Tensor parallelism on GPUs: greedy decoding at TP=2 over NCCL, with CUDA graphs, emits exactly TP=1's tokens in
fp32 (Qwen2.5-7B's shape, a quarter of its layers, random weights), plain and speculative: the drafter cut over the
ranks like the target (`drafter_tp` auto: its layer is far above the rule's size) with NCCL sums, and whole on every
rank with the fused sums."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 900

pytestmark = pytest.mark.gpu


TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
BASE = ["benchmarks/tp_throughput.py", "--shape", "qwen2.5-7b", "--scale", "0.25", "--tp", "2", "--dtype", "float32",
        "--batch", "1", "8", "--max-new-tokens", "32", "--sd", "6_2_12"]  # fmt: skip


def run_tp(tmp_path, extra: list[str]) -> str:
    """tp_throughput.py's output (progress lines and its table), failing the test past LIMIT_S or on a non-zero exit."""
    log = tmp_path / "tp.log"
    with open(log, "w") as f:
        cmd = [sys.executable, *BASE, *extra]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            rc = proc.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:  # every rank's stacks into the log (the script passes SIGUSR1 on), then stop
            proc.send_signal(signal.SIGUSR1)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pytest.fail(f"TP=2 run past {LIMIT_S} s; progress and stacks:\n{log.read_text()[-6000:]}")
    out = log.read_text()
    print(out[-3000:])  # the progress lines (where the seconds went) in the test's report
    assert rc == 0, out[-6000:]
    return out


@TWO_GPUS
def test_tp2_gives_tp1_greedy_tokens_in_fp32_with_graphs(tmp_path):
    out = run_tp(tmp_path, [])
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 4 and all(line.rstrip().endswith("| yes |") for line in rows), out[-2000:]


@TWO_GPUS
def test_tp2_with_fused_sums_inside_the_row_parallel_kernel_gives_tp1_tokens(tmp_path):
    """`--allreduce fused`: every o and down projection of the one-row plain steps is the Triton kernel that sums
    over the ranks inside (`kernels.tp_sum`); 8-row steps and the speculative steps' verify rows the one-shot sum."""
    out = run_tp(tmp_path, ["--allreduce", "fused", "--drafter-tp", "replicate"])
    rows = [line for line in out.splitlines() if line.startswith("| 2 fused |")]
    assert len(rows) == 4 and all(line.rstrip().endswith("| yes |") for line in rows), out[-2000:]
