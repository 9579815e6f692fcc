"""tlt_rt.compare.seeds: the off / auto pairs of several seeds read together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tlt_rt.compare.records import paired_reward_gap
from tlt_rt.compare.seeds import find_pairs, main, seed_rows, summary_lines, write_seeds


def _records(step_s: float, rewards: list[float]) -> list[dict]:
    return [{"step": i, "step_seconds": step_s + 0.01 * (i % 2), "reward_mean": r} for i, r in enumerate(rewards)]


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_paired_reward_gap_is_the_mean_step_difference_with_its_error():
    base, run = _records(2.0, [0.5, 0.4, 0.6, 0.5]), _records(1.0, [0.4, 0.4, 0.5, 0.5])
    d, se, n = paired_reward_gap(base, run)
    assert n == 4 and d == pytest.approx(-0.05) and se == pytest.approx(0.0288675, rel=1e-5)
    assert paired_reward_gap(base, run[:1]) is None  # one step: no spread to judge by


def test_the_seeds_spread_is_the_noise_the_mean_gap_is_judged_against():
    """Two seeds whose pairs each look outside their own steps' noise, in opposite directions: across the seeds
    the mean gap is within their spread. Speedups are per seed, then averaged."""
    pairs = {
        0: (_records(2.0, [0.5, 0.5, 0.6, 0.6]), _records(1.0, [0.4, 0.41, 0.5, 0.51])),
        1: (_records(3.0, [0.5, 0.5, 0.6, 0.6]), _records(1.5, [0.6, 0.61, 0.7, 0.71])),
    }
    rows = seed_rows(pairs, warmup=0)
    assert [r["seed"] for r in rows] == [0, 1] and all(r["steps"] == 4 for r in rows)
    assert rows[0]["speedup"] == pytest.approx(2.005 / 1.005) and rows[1]["speedup"] == pytest.approx(3.005 / 1.505)
    gaps = [r["reward_gap"][0] for r in rows]
    assert gaps[0] == pytest.approx(-0.095) and gaps[1] == pytest.approx(0.105)
    page = "\n".join(summary_lines(rows))
    assert "| 0 | 4 | 2.00 | 1.00 |" in page and "over 2 seeds: +0.005 ± 0.200" in page and "within noise" in page
    same = {s: (b, [dict(r, reward_mean=r["reward_mean"] - 0.1) for r in b]) for s, (b, _) in pairs.items()}
    assert "OUTSIDE the noise" in "\n".join(summary_lines(seed_rows(same, warmup=0)))
    assert "one seed only" in "\n".join(summary_lines(seed_rows({0: pairs[0]}, warmup=0)))


def test_pairs_found_by_name_and_the_page_written(tmp_path, capsys):
    runs = tmp_path / "runs"
    for seed, base_s in ((1, 2.0), (2, 2.2)):
        _write(runs / f"rl-off-s{seed}", _records(base_s, [0.5, 0.5, 0.6]))
        _write(runs / f"rl-auto-s{seed}", _records(1.2, [0.5, 0.6, 0.6]))
    _write(runs / "rl-off-s7", _records(2.0, [0.5, 0.5]))  # no auto run of seed 7: not a pair
    _write(runs / "rl-off", _records(2.0, [0.5, 0.5]))  # no seed in the name
    pairs = find_pairs(runs)
    assert sorted(pairs) == [1, 2] and pairs[1] == (runs / "rl-off-s1", runs / "rl-auto-s1")
    page = write_seeds(pairs, tmp_path / "out", warmup=1)
    assert "rl-auto against rl-off" in page.read_text() and (tmp_path / "out" / "seeds.png").stat().st_size > 1000
    assert main([str(runs), "--out", str(tmp_path / "cli")]) == 0 and "| 2 | 3 |" in capsys.readouterr().out
    assert main([str(tmp_path / "out"), "--out", str(tmp_path / "none")]) == 2  # no pair there
