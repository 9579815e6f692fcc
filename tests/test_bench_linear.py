"""benchmarks/bench_linear.py's --tune filter: which launch settings it tries for a row count (timing needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_linear import SHARED_BUDGET, fits  # noqa: E402


def cfg(bn: int, bk: int, stages: int = 4) -> dict:
    return {"block_n": bn, "block_k": bk, "num_warps": 4, "num_stages": stages}


def test_cuda_core_rows_are_bounded_by_the_product_tile_in_registers():
    assert fits(1, cfg(16, 2048))  # 32,768 elements
    assert not fits(1, cfg(32, 2048))
    assert fits(4, cfg(8, 1024)) and not fits(8, cfg(8, 1024))  # 4 x 8 x 1024 fits, 8 x 8 x 1024 does not


def test_tensor_core_rows_are_bounded_by_their_stages_in_shared_memory():
    # 32 rows (a block of 32) and 64 weight rows, 256 wide, bf16: 48 KB a stage
    per_stage = (32 + 64) * 256 * 2
    assert fits(32, cfg(64, 256, stages=SHARED_BUDGET // per_stage))
    assert not fits(32, cfg(64, 256, stages=SHARED_BUDGET // per_stage + 1))
    assert fits(17, cfg(128, 128, stages=4))  # 17 rows take a block of 32: (32 + 128) x 128 x 2 x 4 = 160 KB
    assert not fits(64, cfg(128, 256, stages=3))  # (64 + 128) x 256 x 2 x 3 = 288 KB
