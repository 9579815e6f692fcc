"""The run report: PNG plots and an HTML page from metrics.jsonl and timelines.jsonl."""

from __future__ import annotations

import json

import pytest

from tlt_rt.report import main, write_report
from tlt_rt.train.rl.metrics import MetricsWriter, engine_segments, percentile, tail_seconds, worker_timeline


def _fake_run(run_dir, steps=3):
    w = MetricsWriter(run_dir, tensorboard=False)
    for s in range(steps):
        rollout = {"start": 0.0, "end": 2.0 + s, "timeline": [
            {"kind": "prefill", "batch": 2, "seconds": 0.2}, {"kind": "decode", "batch": 8, "seconds": 1.0},
            {"kind": "sd", "batch": 1, "seconds": 0.5}]}  # fmt: skip
        timelines = {
            "0": worker_timeline(rollout, None, 4.0 + s),
            "1": worker_timeline({**rollout, "end": 1.0}, {"steps": 3, "start": 1.1, "end": 3.9 + s}, 4.0 + s),
        }
        w.write({"step": s, "reward_mean": 0.1 * s, "accuracy": 0.1 * s, "accept_length": 2.0 + s,
                 "drafter_top1": 0.5, "rollout_seconds": 4.0 + s, "learner_seconds": 1.0}, timelines)  # fmt: skip
    w.close()


def test_report_writes_pngs_and_html(tmp_path):
    _fake_run(tmp_path)
    page = write_report(tmp_path)
    assert page.name == "index.html" and "timeline.png" in page.read_text()
    for name in ("reward.png", "accept.png", "rollout.png", "timeline.png"):
        data = (tmp_path / "report" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, name


def test_report_accept_panel_has_the_ceiling_and_the_drafter_curve(tmp_path, monkeypatch):
    import tlt_rt.report as report

    w = MetricsWriter(tmp_path, tensorboard=False)
    for s in range(3):
        w.write({"step": s, "reward_mean": 0.1, "accuracy": 0.1, "accept_length": 1.5, "accept_ceiling": 2.5,
                 "drafter_accept_online": 1.4 + 0.1 * s, "drafter_accept_frozen": 1.3}, {})  # fmt: skip
    w.close()
    drawn = []
    lines = report._lines
    monkeypatch.setattr(report, "_lines", lambda ax, *a, **k: (lines(ax, *a, **k), drawn.append(ax.get_lines())))
    page = write_report(tmp_path).read_text()
    labels = [line.get_label() for line in drawn[1]]  # the accept plot's top axis, after the reward plot
    assert labels == [label for _, label in report.ACCEPT_SERIES]
    ys = {line.get_label(): list(line.get_ydata()) for line in drawn[1]}
    assert ys["online drafter (step's answers)"] == pytest.approx([1.4, 1.5, 1.6])
    assert "drafter_accept_frozen" in page and "1.3" in page and "accept_ceiling" in page


def test_report_cli_and_empty_run(tmp_path, capsys):
    assert main([str(tmp_path)]) == 0  # an empty run still renders ("no data yet")
    assert (tmp_path / "report" / "timeline.png").is_file()
    assert main([str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_metrics_writer_truncates_on_resume(tmp_path):
    _fake_run(tmp_path, steps=3)
    MetricsWriter(tmp_path, start_step=1, tensorboard=False).close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0]


def test_timeline_helpers():
    tl = [{"kind": "prefill", "batch": 4, "seconds": 1.0}, {"kind": "decode", "batch": 4, "seconds": 1.0},
          {"kind": "sd", "batch": 1, "seconds": 2.0}]  # fmt: skip
    assert engine_segments(tl, 0.0, 8.0) == [["generating", 0.0, 4.0], ["sd", 4.0, 8.0]]
    assert tail_seconds(tl, capacity=8) == (2.0, 4.0)
    bars = worker_timeline({"start": 0.0, "end": 4.0, "timeline": tl}, {"steps": 2, "start": 4.5, "end": 6.0}, 7.0)
    assert [b[0] for b in bars] == ["generating", "sd", "idle", "drafter", "idle"]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 90) == 0.0


def test_plain_steps_by_their_place_after_a_switch():
    from types import SimpleNamespace

    from tlt_rt.train.rl.metrics import plain_step_summary, plain_steps, rollout_metrics

    def e(kind, batch, seconds):
        return {"kind": kind, "batch": batch, "seconds": seconds, "tokens": batch, "start": 0.0, "running": batch}

    # a prefill, three plain steps at 128, an SD step, two plain steps at 128, then plain steps at 64
    tl = [e("prefill", 128, 0.05), e("decode", 128, 0.009), e("decode", 128, 0.004), e("decode", 128, 0.003),
          e("sd", 128, 0.011), e("decode", 128, 0.006), e("decode", 128, 0.005), e("decode", 100, 0.0025)]  # fmt: skip
    got = plain_step_summary(plain_steps(tl))
    assert list(got) == ["64", "128"]  # power-of-two buckets: 100 rows count at 64
    assert got["128"]["1"] == [2, pytest.approx(7.5)]  # after the prefill and after the SD step
    assert got["128"]["2"] == [2, pytest.approx(4.5)] and got["128"]["3+"] == [1, pytest.approx(3.0)]
    assert got["64"] == {"3+": [1, pytest.approx(2.5)]}
    # the step record pools the workers' timelines
    worker = SimpleNamespace(timeline=tl, capacity=128, stats={})
    rec = rollout_metrics([worker, worker], 1.0)
    assert rec["plain_step_ms"]["128"]["2"][0] == 4
    # each worker's buckets, and the pooled ones their sums
    assert [w["128"]["decode_s"] for w in rec["batch_buckets_by_worker"]] == [pytest.approx(0.027)] * 2
    assert rec["batch_buckets"]["128"]["decode_s"] == pytest.approx(0.054)
    assert rec["batch_buckets"]["128"]["sd_rows"] == 256 and rec["batch_buckets"]["64"]["decode_tokens"] == 200
    assert rollout_metrics([worker], 1.0)["batch_buckets_by_worker"] is None  # one worker: the pooled ones say it
