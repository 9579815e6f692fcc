"""benchmarks/gpu_report.py in its CPU smoke mode: every section runs on tiny random models and the report,
plots and numbers come out whole."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_report  # noqa: E402


def _numbers(obj):
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return
    if isinstance(obj, int | float):
        yield float(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_report")
    gpu_report.main(["--out", str(out), "--smoke"])
    return out


def test_smoke_writes_every_section_and_plot(smoke):
    md = (smoke / "report.md").read_text()
    assert md.startswith("## ")
    assert "Command: `python benchmarks/gpu_report.py --out" in md and "at commit `" in md
    for heading in ("Step cost against the HBM floor", "Speculative speedup per verify budget",
                    "Adaptivity on a long-tail rollout", "CUDA-graph pool memory"):  # fmt: skip
        assert f"### {heading}" in md
    assert "Skipped: CUDA graphs need a GPU" in md
    assert "(projection, tiny-7b)" in md
    for png in ("roofline.png", "strategies.png", "adaptivity.png"):
        data = (smoke / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
        assert f"]({png})" in md


def test_smoke_numbers_are_finite(smoke):
    res = json.loads((smoke / "results.json").read_text())
    for key in ("roofline", "strategies", "adaptivity", "section_seconds"):
        assert res[key], key
    values = list(_numbers({k: res[k] for k in ("roofline", "strategies", "adaptivity")}))
    assert values and all(math.isfinite(v) for v in values)
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in res["roofline"])
    assert all(r["speedup"] > 0 for r in res["strategies"])
    assert all(q["projected"] > 0 and q["decode_s"] > 0 and q["sd_s"] > 0 for q in res["projections"])
    # one projection per (larger model, batch, strategy); the policy picks the best projected rate or off
    smoke_args = gpu_report.SMOKE_DEFAULTS
    proj = res["projections"]
    assert len(proj) == len(smoke_args["models"][1:]) * len(smoke_args["strategy_batches"]) * len(
        smoke_args["strategies"]
    )
    for key, choice in res["policy_choice"].items():
        model, batch = key.split("@")
        sel = [q for q in proj if q["model"] == model and q["batch"] == int(batch)]
        best = max(sel, key=lambda q: q["projected"])
        assert choice == (best["strategy"] if best["projected"] > 1.0 else "off")
        assert [q["strategy"] for q in sel if q.get("chosen")] == ([] if choice == "off" else [choice])
    runs = res["adaptivity"]["runs"]
    assert len(runs) == 3 and {"off", "auto"} < set(runs)
    assert next(k for k in runs if k.startswith("on "))[3:] in gpu_report.SMOKE_DEFAULTS["strategies"]
    # greedy and exact lengths: every mode generates the same number of tokens, each request its own length
    assert len({r["tokens"] for r in runs.values()}) == 1
    targets = res["adaptivity"]["targets"]
    levels = runs["off"]["levels"]
    assert runs["off"]["lengths"] == [min(lv for lv in levels if lv >= t) for t in targets]
    assert runs["off"]["sd_steps"] == 0 and runs["off"]["steps"] > 0
    assert all(e["kind"] in ("prefill", "decode", "sd") and e["running"] >= 0 for e in runs["auto"]["timeline"])


def test_length_levels_and_lognormal():
    lengths, mu, sigma = gpu_report.long_tail_lengths([10, 20, 40, 80], 200, 64, 0.3, seed=1)
    assert len(lengths) == 200 and min(lengths) >= 2 and max(lengths) <= 64 and sigma >= 0.3
    levels = gpu_report.length_levels(lengths, 4)
    assert levels == sorted(levels) and levels[-1] == max(lengths) and len(levels) <= 4
    assert gpu_report.length_levels([5, 5, 5], 8) == [5]


def test_sections_are_checked():
    with pytest.raises(SystemExit):
        gpu_report.parse_args(["--out", "x", "--sections", "roofline,nope"])
    args = gpu_report.parse_args(["--out", "x", "--smoke", "--batches", "2", "8"])
    assert args.batches == [2, 8] and args.strategies == gpu_report.SMOKE_DEFAULTS["strategies"]
