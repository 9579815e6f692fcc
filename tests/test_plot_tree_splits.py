"""benchmarks/plot_tree_splits.py: `bench_attention.py --tree-splits` logs read back from their markdown table (the
kept record of one H200 run among them), drawn one panel a log; a clear error for a log without the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from plot_tree_splits import main, read_log  # noqa: E402


def test_a_kept_log_reads_back_row_by_row():
    title, rows = read_log(str(ROOT / "benchmarks/data/tree-splits-qwen2.5-coder-1.5b-h200-c2ceae0.log"))
    assert title == "qwen2.5-coder-1.5b" and len(rows) == 10
    assert rows[0] == dict(batch=1, context=128, tree=32, table=32768, splits=64, every=0.0213, used=0.0152)
    assert {r["table"] for r in rows} == {32768, 2624}


def test_logs_plot_one_panel_each_and_a_log_without_the_table_is_refused(tmp_path):
    log = tmp_path / "t.log"
    log.write_text("# attention heads of tiny: 4 query, 2 KV, head size 64\n\n"
                   "| batch | context | tree | table | splits | every split ms | used splits ms | x | equal |\n"
                   "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|\n"
                   "| 1 | 128 | 4 | 32768 | 64 | 0.0150 | 0.0100 | 1.50x | yes |\n")  # fmt: skip
    out = tmp_path / "fig.png"
    assert main([str(out), str(log), str(log)]) == 0
    assert out.stat().st_size > 10_000
    empty = tmp_path / "empty.log"
    empty.write_text("no table here\n")
    with pytest.raises(ValueError, match="no `bench_attention.py --tree-splits` table"):
        read_log(str(empty))
