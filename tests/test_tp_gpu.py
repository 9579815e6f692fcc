"""Tensor parallelism on GPUs: greedy decoding at TP=2 over NCCL, with CUDA graphs, emits exactly TP=1's tokens in
fp32 (Qwen2.5-7B's shape, a quarter of its layers, random weights), plain and speculative (a replicated drafter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_gives_tp1_greedy_tokens_in_fp32_with_graphs():
    cmd = [sys.executable, "benchmarks/tp_throughput.py", "--shape", "qwen2.5-7b", "--scale", "0.25", "--tp", "2",
           "--dtype", "float32", "--batch", "1", "8", "--max-new-tokens", "32", "--sd", "6_2_12"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 4 and all(line.rstrip().endswith("| yes |") for line in rows), done.stdout[-2000:]
