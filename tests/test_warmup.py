"""Drafter warm-up end to end on SmolLM2 with tiny settings: data from the target, training, report, export."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file

from tlt_rt.models.eagle_export import load_eagle
from tlt_rt.train.drafter.warmup import BASE_LR, default_lr, gen_buckets, warmup


def test_warmup_trains_measures_and_exports(tmp_path):
    rep = warmup(
        None,
        tmp_path / "drafter",
        num_prompts=3,
        held_out=2,
        samples=1,
        steps=3,
        max_new_tokens=12,
        strategy="3_2_4",
        batch_tokens=256,
        device="cpu",
        progress=False,
    )
    assert rep["generated_tokens"] > 0 and rep["train_steps"] == 3
    for k in ("accept_length_before", "accept_length_after"):
        assert 1.0 <= rep[k] <= 4.0 and math.isfinite(rep[k])
    # measured at the data's temperature and greedy; the RL-temperature entry is the headline pair
    assert set(rep["accept_length"]) == {"0.9", "0"}
    headline = {"before": rep["accept_length_before"], "after": rep["accept_length_after"]}
    assert {k: rep["accept_length"]["0.9"][k] for k in headline} == headline
    assert all(1.0 <= v <= 4.0 for acc in rep["accept_length"].values() for v in acc.values())
    # the perfect drafter of the same tree on the same held-out answers bounds the trained one's accept length
    assert all(acc["after"] <= acc["ceiling"] + 1e-9 for acc in rep["accept_length"].values())
    assert math.isfinite(rep["final_loss"])
    assert rep["lr"] == default_lr(576) == BASE_LR  # no lr given: SmolLM2's width keeps the tuned rate
    saved = json.loads((tmp_path / "drafter" / "warmup.json").read_text())
    assert saved["drafter"] == rep["drafter"]
    from tlt_rt.models import load_target

    assert load_eagle(tmp_path / "drafter", load_target(None)).fc.weight.shape[1] == 2 * 576


def test_default_steps_follow_the_data(tmp_path):
    rep = warmup(
        None,
        tmp_path / "d",
        num_prompts=2,
        held_out=1,
        samples=1,
        max_new_tokens=8,
        strategy="3_2_4",
        batch_tokens=64,
        device="cpu",
        progress=False,
        epochs=2.0,
        also_strategies=("2_2_3", "3_2_4", "2_2_3"),
    )
    # two passes over every generated (prompt + answer) token at 64 tokens a step
    assert rep["train_steps"] >= 2 * (rep["generated_tokens"] // 64)
    # the trained drafter measured with each strategy asked for, once each, the run's own first
    by = rep["accept_by_strategy"]
    assert list(by) == ["3_2_4", "2_2_3"]
    main = rep["accept_length"][f"{rep['temperature']:g}"]
    assert by["3_2_4"]["accept"] == main["after"] and by["3_2_4"]["ceiling"] == main["ceiling"]
    assert all(r["ceiling"] >= 1.0 and r["accept"] >= 1.0 for r in by.values())
    assert all(r["ratio"] == r["accept"] / r["ceiling"] for r in by.values())
    # a warm-up repeats: the same seed gives the same data, initial drafter and training, whatever ran before
    torch.manual_seed(12345)
    again = warmup(None, tmp_path / "e", num_prompts=2, held_out=1, samples=1, max_new_tokens=8, strategy="3_2_4",
                   batch_tokens=64, device="cpu", progress=False, epochs=2.0)  # fmt: skip
    assert again["final_loss"] == rep["final_loss"] and again["generated_tokens"] == rep["generated_tokens"]
    a, b = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "d", tmp_path / "e"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_greedy_answers_join_the_data_and_the_cosine_schedule_runs(tmp_path):
    kw = dict(num_prompts=2, held_out=1, samples=1, steps=4, max_new_tokens=8, strategy="3_2_4", device="cpu",
              progress=False, eval_temperatures=())  # fmt: skip
    plain = warmup(None, tmp_path / "a", greedy_answers=False, batch_tokens=64, **kw)
    mixed = warmup(None, tmp_path / "b", lr_schedule="cosine", **kw)  # greedy answers by default
    # the same sampled answers (same seed) plus one greedy answer per training prompt (<= 8 tokens each)
    assert plain["generated_tokens"] < mixed["generated_tokens"] <= plain["generated_tokens"] + 2 * 8
    assert mixed["greedy_answers"] and mixed["lr_schedule"] == "cosine" and not plain["greedy_answers"]
    assert math.isfinite(mixed["final_loss"])
    assert plain["batch_tokens"] == 64 and mixed["batch_tokens"] == 1024  # the CPU's default packed row


def test_the_curve_measures_accept_against_its_ceiling_through_training(tmp_path):
    rep = warmup(None, tmp_path / "c", num_prompts=2, held_out=2, samples=1, steps=6, max_new_tokens=10,
                 strategy="3_2_4", batch_tokens=64, device="cpu", progress=False, eval_temperatures=(),
                 curve_points=3)  # fmt: skip
    curve = rep["curve"]
    assert [c["steps"] for c in curve] == [2, 4, 6] and [c["train_tokens"] for c in curve] == [128, 256, 384]
    # at T > 0 a drafted token can pass the rejection test outside the target's top-k, so on 2 short answers the
    # drafter may land above the top-k ceiling: both are only bounded by the tree's depth + 1
    assert all(1.0 <= c["accept"] <= 4.0 and 1.0 <= c["ceiling"] <= 4.0 for c in curve)
    assert curve[-1]["accept"] == rep["accept_length_after"]  # the last point is the final measure
    assert all(a["seconds"] < b["seconds"] for a, b in zip(curve, curve[1:], strict=False))
    # where the time went: the parts are positive and fit in the whole
    parts = [rep[k] for k in ("load_seconds", "generation_seconds", "train_seconds", "measure_seconds")]
    assert all(p > 0 for p in parts) and sum(parts) <= rep["total_seconds"]
    # and within the generation: prefill, decode steps (2 prompts x 1 sample, then their greedy answers: at most
    # 2 sequences a step, 10 tokens each) and the rest fit in its seconds
    g = rep["generation_split"]
    gen = g["prefill_seconds"] + g["decode_seconds"] + g["sd_seconds"] + g["other_seconds"]
    assert g["prefill_seconds"] > 0 and g["decode_seconds"] > 0 and g["sd_seconds"] == 0
    assert g["other_seconds"] >= 0 and gen <= rep["generation_seconds"] + 1e-6 and g["preemptions"] == 0
    assert 1 <= g["mean_decode_batch"] <= 2 and g["decode_rows"] <= rep["generated_tokens"]
    assert (tmp_path / "c" / "curve.png").stat().st_size > 0
    assert warmup(None, tmp_path / "n", num_prompts=1, held_out=1, samples=1, steps=1, max_new_tokens=4,
                  strategy="3_2_4", device="cpu", progress=False, eval_temperatures=())["curve"] == []  # fmt: skip
    assert not (tmp_path / "n" / "curve.png").exists()


def test_default_lr_falls_as_one_over_width_above_smollm2s():
    assert default_lr(256) == default_lr(576) == BASE_LR
    assert math.isclose(default_lr(1152), BASE_LR / 2)
    assert math.isclose(default_lr(1536), BASE_LR * 576 / 1536)  # Qwen2.5-1.5B: 3.4e-4
    assert default_lr(3584) < default_lr(1536) < default_lr(896)  # 7B < 1.5B < 0.5B


def test_the_generating_engine_captures_quarters_of_its_batch():
    assert gen_buckets(512) == [128, 256, 384, 512]
    assert gen_buckets(256) == [64, 128, 192, 256]
    assert gen_buckets(2) == [1, 2]


def test_every_measure_after_training_runs_on_an_engine_built_with_the_reduced_vocabulary(tmp_path, monkeypatch):
    """A captured step keeps the draft head it was captured with: the engine that measured the untrained drafter
    (full vocabulary) must not measure the trained one, whose head covers the reduced vocabulary. Every engine
    with a drafter built after the vocabulary is set sees it; the untrained measure's is the only one without."""
    from tlt_rt.train.drafter import warmup_run

    seen = []

    class Recording(warmup_run.Engine):
        def __init__(self, target, drafter=None, *args, **kw):
            super().__init__(target, drafter, *args, **kw)
            if drafter is not None:
                seen.append((drafter.d2t is not None, self))

    monkeypatch.setattr(warmup_run, "Engine", Recording)
    measured = []
    accept = warmup_run.accept_and_answers

    def counting(spec, prompts, params):
        measured.append(spec)
        return accept(spec, prompts, params)

    monkeypatch.setattr(warmup_run, "accept_and_answers", counting)
    warmup(None, tmp_path / "v", num_prompts=2, held_out=1, samples=1, steps=2, max_new_tokens=8, strategy="3_2_4",
           batch_tokens=64, device="cpu", progress=False, eval_temperatures=(), curve_points=2,
           draft_vocab=256)  # fmt: skip
    assert [has for has, _ in seen] == [False, True]  # the untrained measure's engine, then the trained one's
    trained = seen[1][1]
    assert measured and all(spec is trained for spec in measured)  # the curve's point and the final measure


def test_the_answers_stay_on_the_gpu_only_where_their_copy_fits(monkeypatch):
    from types import SimpleNamespace

    from tlt_rt.train.drafter import warmup_data

    # 4.0M rows of 1,536 bf16 values (the 1.5B's 3,072 prompts' answers), as shapes only
    hidden = [torch.empty(1000, 1536, dtype=torch.bfloat16, device="meta") for _ in range(4000)]
    need = 4000 * 1000 * 1536 * 2
    gpu = SimpleNamespace(device=torch.device("cuda:0"))
    for free, where in ((need / warmup_data.ANSWERS_GPU_SHARE + 1, "cuda"), (need, "cpu")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (int(free), int(2 * free)))
        assert warmup_data.answers_device(gpu, hidden).type == where
    assert warmup_data.answers_device(SimpleNamespace(device=torch.device("cpu")), hidden).type == "cpu"
    # keep_answers: a CPU run's answers, and any set with one answer in host memory already, stay in host memory
    cpu_rows = [torch.zeros(3, 4), torch.zeros(2, 4)]
    assert all(h.device.type == "cpu" for h in warmup_data.keep_answers(gpu, cpu_rows))
