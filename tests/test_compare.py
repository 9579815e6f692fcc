import json
import math

import pytest

from tlt_rt.compare import agreement, bucket_table, drafter_curve_lines, main, run_means, speedup, write_compare
from tlt_rt.report import main as report_main


def _write_run(folder, step_seconds, rewards, **per_step):
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for i, (s, r) in enumerate(zip(step_seconds, rewards, strict=True)):
            rec = {"step": i, "step_seconds": s, "rollout_seconds": s / 2, "reward_mean": r}
            rec.update({k: v[i] for k, v in per_step.items() if v[i] is not None})
            f.write(json.dumps(rec) + "\n")


def _rows(text):
    return {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}


def test_means_leave_out_warmup_steps_and_speedup_is_against_the_first_run(tmp_path):
    _write_run(tmp_path / "off", [30.0, 10.0, 12.0], [0.1, 0.2, 0.3])
    _write_run(tmp_path / "auto", [40.0, 5.0, 6.0], [0.1, 0.25, 0.3])
    assert run_means([{"step": 0, "step_seconds": 9.0}])["step_seconds"] == 9.0  # a single step is kept
    rows = _rows(write_compare([tmp_path / "off", tmp_path / "auto"], tmp_path / "cmp").read_text())
    assert "| 11.00 |" in rows["off"] and "| 1.00x ± " in rows["off"]
    assert "| 5.50 |" in rows["auto"] and "| 2.00x ± " in rows["auto"]  # 11.0 / 5.5
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 1000
    # warmup=0 counts every step
    rows = _rows(write_compare([tmp_path / "off", tmp_path / "auto"], tmp_path / "cmp0", warmup=0).read_text())
    assert "| 17.33 |" in rows["off"] and "| 17.00 |" in rows["auto"]


def test_speedup_standard_error_by_the_delta_method():
    base = [{"step": i, "step_seconds": s} for i, s in enumerate([9.0, 10.0, 12.0, 14.0])]
    run = [{"step": i, "step_seconds": s} for i, s in enumerate([9.0, 5.0, 6.0, 7.0])]
    ratio, se = speedup(base, run, warmup=1)
    assert ratio == pytest.approx(12.0 / 6.0)
    se_a, se_b = 2.0 / math.sqrt(3), 1.0 / math.sqrt(3)  # stdev 2 and 1 over three steps
    assert se == pytest.approx(2.0 * math.hypot(se_a / 12.0, se_b / 6.0))
    assert speedup(base, [{"step": 0}], warmup=1) is None


def test_agreement_pairs_rewards_by_step_and_judges_held_out_by_binomial_noise():
    base = [{"step": i, "reward_mean": r} for i, r in enumerate([0.2, 0.3, 0.4, 0.5])]
    same = [{"step": i, "reward_mean": r} for i, r in enumerate([0.22, 0.29, 0.41, 0.49])]
    lines = agreement(base, same)
    assert len(lines) == 1 and "paired over 4 steps" in lines[0] and "within noise" in lines[0]
    worse = [{"step": i, "reward_mean": r - 0.1 + 0.001 * i} for i, r in enumerate([0.2, 0.3, 0.4, 0.5])]
    outside = agreement(base, worse)
    assert "OUTSIDE" in outside[0] and "--seeds" in outside[1]  # what one pair cannot tell, and what can
    base[-1].update(heldout_accuracy_end=0.40, heldout_n_end=100)
    same[-1].update(heldout_accuracy_end=0.45, heldout_n_end=100)
    held = agreement(base, same)[1]
    assert "baseline 0.400 (n=100), run 0.450 (n=100)" in held and "within noise" in held
    same[-1].update(heldout_accuracy_end=0.70)
    assert "OUTSIDE" in agreement(base, same)[1]


def test_bucket_table_sums_measured_steps_per_batch_size():
    def rec(step, sd_s):
        return {"step": step, "batch_buckets": {"1": dict(decode_s=1.0, sd_s=sd_s, decode_tokens=100, sd_tokens=60,
                                                          sd_rows=20 if sd_s else 0)}}  # fmt: skip

    runs = {"off": [rec(0, 0.0), rec(1, 0.0)], "auto": [rec(0, 9.0), rec(1, 1.0)]}
    table = bucket_table(runs, warmup=1)
    # off: 1 s, 100 tokens (+60 counted by the record) -> 160 tok/s; auto: 2 s, 50% SD, accept 60/20
    assert table[2] == "| 1 | 1.0 | 160 | 0% | - | 2.0 | 80 | 50% | 3.00 |"
    assert bucket_table({"a": [{"step": 0}], "b": [{"step": 0}]}) == []


def test_report_with_two_runs_writes_the_comparison(tmp_path, capsys):
    lengths = [[10, 12, 200, 11], [9, 30, 15, 12], [20, 22, 21, 400]]
    _write_run(tmp_path / "off", [3.0, 2.0, 2.2], [0.1, 0.2, 0.3], response_lengths=lengths,
               heldout_accuracy=[0.1, None, 0.2], heldout_n=[50, None, 50])  # fmt: skip
    _write_run(tmp_path / "auto", [3.0, 1.5, 1.4], [0.1, 0.2, 0.3], response_lengths=lengths,
               accept_length=[1.5, 1.8, 1.9], accept_ceiling=[2.5, 2.6, 2.6], heldout_accuracy=[0.1, None, 0.22],
               heldout_n=[50, None, 50])  # fmt: skip
    assert report_main([str(tmp_path / "off"), str(tmp_path / "auto")]) == 0
    text = capsys.readouterr().out
    assert "Learning, auto against off" in text and "response lengths of the first 3 steps" in text
    assert (tmp_path / "auto" / "report" / "compare-off" / "compare.png").is_file()
    assert "| 2.60 |" in _rows(text)["auto"]  # the ceiling column


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    _write_run(tmp_path / "a", [1.0], [0.0])
    with pytest.raises(ValueError, match="at least two"):
        write_compare([tmp_path / "a"], tmp_path / "o")
    with pytest.raises(ValueError, match="warmup"):
        write_compare([tmp_path / "a", tmp_path / "a"], tmp_path / "o", warmup=-1)
    assert main([str(tmp_path / "a"), str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert report_main([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2


def test_runs_of_different_lengths_are_compared_on_their_common_steps(tmp_path):
    _write_run(tmp_path / "off", [3.0, 2.0, 2.0, 9.0], [0.1, 0.2, 0.3, 0.4])
    _write_run(tmp_path / "auto", [3.0, 1.0, 1.0], [0.1, 0.2, 0.3])
    text = write_compare([tmp_path / "off", tmp_path / "auto"], tmp_path / "cmp").read_text()
    assert "Only the first 3 steps are compared: off ran more." in text
    assert "| 2.00x ± " in _rows(text)["auto"]  # off's fourth step (9 s) is left out


def test_drafter_curve_means_over_the_steps_that_logged_it(tmp_path):
    ceiling, online, frozen = [2.5, 2.6, 2.7, 2.8], [1.2, 1.6, None, 2.0], [1.2, 1.3, None, 1.1]
    _write_run(tmp_path / "off", [3.0, 2.0, 2.2, 2.1], [0.1, 0.2, 0.3, 0.3])  # records of before the curve
    _write_run(tmp_path / "auto", [3.0, 1.5, 1.4, 1.4], [0.1, 0.2, 0.3, 0.3], accept_length=[1.5, 1.8, 1.9, 1.9],
               accept_ceiling=ceiling, drafter_accept_online=online, drafter_accept_frozen=frozen)  # fmt: skip
    text = write_compare([tmp_path / "off", tmp_path / "auto"], tmp_path / "cmp").read_text()
    # steps 0, 1 and 3 have all three: online (1.2 + 1.6 + 2.0) / 3, frozen 3.6 / 3, ceiling 7.9 / 3;
    # online - frozen paired per step: 0.0, 0.3, 0.9 (mean 0.4, standard error 0.2646)
    line = "- auto, over 3 steps: online 1.60, frozen 1.20, ceiling 2.63 tokens per step; online - frozen +0.40 ± 0.53"
    assert line in text.splitlines()
    assert not any(x.startswith("- off, over") for x in text.splitlines())
    with_curve = (tmp_path / "cmp" / "compare.png").read_bytes()
    # the same runs without the curve: the page has no such section, the plot has fewer lines
    _write_run(tmp_path / "auto0", [3.0, 1.5, 1.4, 1.4], [0.1, 0.2, 0.3, 0.3], accept_length=[1.5, 1.8, 1.9, 1.9],
               accept_ceiling=ceiling)  # fmt: skip
    text = write_compare([tmp_path / "off", tmp_path / "auto0"], tmp_path / "cmp0").read_text()
    assert "online" not in text and "| 2.70 |" in _rows(text)["auto0"]  # the ceiling column, steps 1..3
    assert (tmp_path / "cmp0" / "compare.png").read_bytes() != with_curve
    assert drafter_curve_lines({"a": [{"step": 0, "drafter_accept_online": 1.0}]}) == []  # frozen, ceiling absent


def test_equal_work_times_the_baselines_tokens_at_the_runs_rates():
    from tlt_rt.compare import equal_work

    def rec(step_s, b1, b8, workers=1):  # bucket -> (seconds, tokens)
        rows = {str(b): {"decode_s": s, "decode_tokens": t, "sd_s": 0.0, "sd_tokens": 0, "sd_rows": 0}
                for b, (s, t) in (("1", b1), ("8", b8 or (0.0, 0))) if s}  # fmt: skip
        return {"step_seconds": step_s, "batch_buckets": rows, "worker_rollout_seconds": [1.0] * workers}

    # baseline: 4 s at batch 1 (2,000 tokens), 1 s at batch 8 (4,000); the run decodes batch 1 twice as fast,
    # batch 8 as fast, and its tail happened to be short (only 500 tokens at batch 1)
    base = [rec(9.0, (4.0, 2000), (1.0, 4000))] * 3
    run = [rec(3.0, (0.5, 500), (1.0, 4000))] * 3
    est = equal_work(base, run, warmup=1)
    assert est["decode_ratio"] == pytest.approx(5.0 / 3.0)  # 5 s of decode take 2 + 1 s at the run's rates
    assert est["step_seconds"] == pytest.approx(7.0) and est["speedup"] == pytest.approx(9.0 / 7.0)
    # a bucket the run never visited keeps the baseline's rate; two workers share the saving of wall time
    est = equal_work([rec(9.0, (4.0, 2000), (1.0, 4000), workers=2)] * 2, [rec(3.0, (0.5, 500), None)] * 2)
    assert est["step_seconds"] == pytest.approx(9.0 - 2.0 / 2)
    assert equal_work([{"step_seconds": 1.0}], run) is None  # no bucket records: nothing to estimate


def test_the_page_gives_the_speedup_at_equal_work(tmp_path):
    slow = {"1": {"decode_s": 4.0, "decode_tokens": 2000, "sd_s": 0.0, "sd_tokens": 0, "sd_rows": 0}}
    fast = {"1": {"decode_s": 0.0, "decode_tokens": 0, "sd_s": 1.0, "sd_tokens": 1000, "sd_rows": 250}}
    _write_run(tmp_path / "off", [9.0, 9.0, 9.0], [0.1, 0.1, 0.1], batch_buckets=[slow] * 3)
    _write_run(tmp_path / "auto", [4.0, 4.0, 4.0], [0.1, 0.1, 0.1], batch_buckets=[fast] * 3)
    text = write_compare([tmp_path / "off", tmp_path / "auto"], tmp_path / "cmp").read_text()
    # 2,000 tokens at 1,000 tokens/s: 2 of 4 s saved, a 7 s step
    assert "decodes off's tokens 2.00x as fast" in text and "a step of 7.00 s: **1.29x** at equal work" in text


def test_equal_work_follows_the_worker_that_decoded_the_tail():
    """With each worker's buckets recorded, the saving comes off each worker's own rollout and the step waits
    for the last one: the lone tail's saving counts in full, not halved over the workers."""
    from tlt_rt.compare import equal_work

    def rows(b1_s, b1_tok, b8_s, b8_tok):
        zero = {"sd_s": 0.0, "sd_tokens": 0, "sd_rows": 0}
        return {"1": {"decode_s": b1_s, "decode_tokens": b1_tok, **zero},
                "8": {"decode_s": b8_s, "decode_tokens": b8_tok, **zero}}  # fmt: skip

    # worker 0 done at 2 s (batch 8 only), worker 1 at 6 s, 4 of them at batch 1 (2,000 tokens)
    per = [rows(0.0, 0, 1.0, 4000), rows(4.0, 2000, 1.0, 4000)]
    pooled = rows(4.0, 2000, 2.0, 8000)
    base = [{"step_seconds": 8.0, "worker_rollout_seconds": [2.0, 6.0], "batch_buckets": pooled,
             "batch_buckets_by_worker": per}] * 2  # fmt: skip
    run = [{"step_seconds": 4.0, "batch_buckets": rows(1.0, 1000, 1.0, 4000)}] * 2  # batch 1 twice as fast
    est = equal_work(base, run, warmup=1)
    # worker 1 saves 2 s and ends at 4 s, still the last: the step loses 2 s
    assert est["step_seconds"] == pytest.approx(6.0) and est["speedup"] == pytest.approx(8.0 / 6.0)
    for r in base:  # without the per-worker records the 2 s are spread over the two workers
        r.pop("batch_buckets_by_worker", None)
    assert equal_work(base, run, warmup=1)["step_seconds"] == pytest.approx(7.0)


def test_plain_step_table_weights_each_steps_median_by_its_count():
    from tlt_rt.compare import plain_step_table

    off = [{"plain_step_ms": {}}, {"plain_step_ms": {"128": {"3+": [10, 2.5]}}}]
    auto = [{}, {"plain_step_ms": {"128": {"1": [1, 9.0], "2": [3, 4.0]}}},
            {"plain_step_ms": {"128": {"2": [1, 8.0]}, "1": {"3+": [2, 2.0]}}}]  # fmt: skip
    rows = plain_step_table({"off": off, "auto": auto}, warmup=1)
    assert rows[0] == "| batch | off ms (1 / 2 / 3+) | auto ms (1 / 2 / 3+) |"
    assert rows[2] == "| 1 | - / - / - | - / - / 2.00 |"
    assert rows[3] == "| 128 | - / - / 2.50 | 9.00 / 5.00 / - |"  # (3 x 4.0 + 1 x 8.0) / 4
    assert plain_step_table({"a": [{}], "b": [{}]}) == []


def test_the_page_names_updates_that_compiled_and_the_means_without_them(tmp_path):
    """A compile inside a measured update is listed with its learner seconds, and each run's mean step time is
    given without such steps, the speedup over the first run's steps without its own beside it."""
    _write_run(tmp_path / "off", [9.0, 4.0, 4.0, 4.0], [0.1] * 4, learner_compiles=[1, 0, 0, 0],
               learner_seconds=[6.0, 1.0, 1.0, 1.0])  # fmt: skip
    _write_run(tmp_path / "auto", [9.0, 2.0, 8.0, 2.0], [0.1] * 4, learner_compiles=[1, 0, 2, 0],
               learner_seconds=[6.0, 1.0, 7.0, 1.0])  # fmt: skip
    text = write_compare([tmp_path / "off", tmp_path / "auto"], tmp_path / "cmp").read_text()
    assert "Compiles inside the measured updates" in text
    want = "- auto: updates that compiled a graph: step 2 (7.0 s); without them a step takes 2.00 s, 2.00x of off's"
    assert want in text
    assert "- off:" not in text  # its only compile was in step 0, before the measured steps
    _write_run(tmp_path / "calm", [9.0, 3.0, 3.0, 3.0], [0.1] * 4, learner_compiles=[1, 0, 0, 0])
    assert "Compiles inside" not in write_compare([tmp_path / "off", tmp_path / "calm"], tmp_path / "c2").read_text()
