"""benchmarks/e2e_rl.py on CPU with the tiny policy: both runs, then the comparison page."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("e2e_rl", ROOT / "benchmarks" / "e2e_rl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_e2e_runs_off_and_auto_and_writes_the_page(tiny, tmp_path, capsys):
    keys = [f"model.path={tiny / 'policy'}", "model.dtype=float32", "model.device=cpu", "model.max_context=256",
            "task.kind=jsonl", f"task.path={tiny / 'data.jsonl'}", f"task.eval_path={tiny / 'data.jsonl'}",
            "logging.eval_every=2", "logging.eval_prompts=2", "rollout.max_new_tokens=6", "rollout.strategies=[3_2_4]",
            "rl.prompts_per_step=2", "rl.group_size=2", "rl.micro_batch=4", "cluster.num_workers=1",
            "cluster.gpus_per_worker=0", "cluster.cpus_per_worker=1", "tensorboard=false"]  # fmt: skip
    script = _script()
    rc = script.main(["--config", str(ROOT / "configs" / "smollm2-arith.yaml"), "--steps", "3",
                         "--timing-warmup", "1", "--out", str(tmp_path), "--fresh-drafter", "--", *keys])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("[step 3/3") == 2  # both runs' step lines reach the console
    for name in ("rl-off", "rl-auto"):
        records = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1, 2]
        assert "heldout_accuracy" in records[0] and "heldout_accuracy_end" in records[-1]
        assert script.steps_done(tmp_path / "runs" / name) == 3  # what the auto run's step count follows
        assert not (tmp_path / "runs" / name / "checkpoints").exists()  # a benchmark writes none by default
    page = (tmp_path / "compare.md").read_text()
    assert "| rl-auto | 3 |" in page and "Learning, rl-auto against rl-off" in page
    assert (tmp_path / "compare.png").stat().st_size > 1000


def test_e2e_refuses_too_few_steps(tmp_path):
    with pytest.raises(SystemExit):
        _script().main(["--steps", "2", "--timing-warmup", "2", "--out", str(tmp_path)])


def test_e2e_warmup_only_passes_its_arguments_on_and_stops(tmp_path, monkeypatch):
    script = _script()
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return script.subprocess.CompletedProcess(cmd, 0, stdout="accept length ... 52% of it\n", stderr="")

    monkeypatch.setattr(script.subprocess, "run", fake_run)
    monkeypatch.setattr(script, "run", lambda *a, **k: pytest.fail("--warmup-only started an RL run"))
    rc = script.main(["--config", str(ROOT / "configs" / "smollm2-tail-gpu.yaml"), "--out", str(tmp_path),
                      "--warmup-only", "--warmup-arg=--hidden-weight=0", "--warmup-arg=--unroll=5"])  # fmt: skip
    assert rc == 0 and len(seen) == 1
    cmd = seen[0]
    assert cmd[2] == "tlt_rt.train.drafter.warmup" and cmd[-2:] == ["--hidden-weight=0", "--unroll=5"]
    assert "52% of it" in (tmp_path / "warmup.log").read_text()
    assert not (tmp_path / "runs").exists()
    # the warm-up's size comes from the config's drafter section unless the command line gives it
    i = cmd.index("--prompts")
    assert cmd[i + 1] == "256" and cmd[cmd.index("--epochs") + 1] == "10.0"
    qwen = str(ROOT / "configs" / "qwen2.5-1.5b-math-gpu.yaml")
    for extra, want in (([], ("3072", "1.5", "512")), (["--warmup-prompts", "64"], ("64", "1.5", "512"))):
        seen.clear()
        assert script.main(["--config", qwen, "--out", str(tmp_path / "q"), "--warmup-only", *extra]) == 0
        cmd = seen[0]
        got = tuple(cmd[cmd.index(k) + 1] for k in ("--prompts", "--epochs", "--max-new-tokens"))
        assert got == want, got
        assert cmd[cmd.index("--unroll") + 1] == "3"  # the config's drafter.unroll
        assert "--lr" not in cmd  # no drafter.warmup_lr: the warm-up's width rule
    small = str(ROOT / "configs" / "qwen2.5-0.5b-math-gpu.yaml")
    seen.clear()
    assert script.main(["--config", small, "--out", str(tmp_path / "s"), "--warmup-only"]) == 0
    assert seen[0][seen[0].index("--unroll") + 1] == "5" and seen[0][seen[0].index("--prompts") + 1] == "6144"
    assert seen[0][seen[0].index("--lr") + 1] == "0.0009"  # its drafter.warmup_lr


def test_e2e_warmup_only_needs_a_warmup(tmp_path):
    with pytest.raises(SystemExit):
        _script().main(["--out", str(tmp_path), "--warmup-only", "--fresh-drafter"])


def test_e2e_seeds_with_the_policy_held_run_a_pair_per_seed_and_the_seeds_page(tiny, tmp_path, capsys):
    """--seeds 3 4 --hold-policy: an off / auto pair per seed (rl.seed set, rl.lr=0, no held-out evaluation),
    each pair's page in OUT/seedN, then OUT/seeds.md and its figure across the seeds."""
    keys = [f"model.path={tiny / 'policy'}", "model.dtype=float32", "model.device=cpu", "model.max_context=256",
            "task.kind=jsonl", f"task.path={tiny / 'data.jsonl'}", "rollout.max_new_tokens=6",
            "rollout.strategies=[3_2_4]", "rl.prompts_per_step=2", "rl.group_size=2", "rl.micro_batch=4",
            "cluster.num_workers=1", "cluster.gpus_per_worker=0", "cluster.cpus_per_worker=1",
            "tensorboard=false"]  # fmt: skip
    script = _script()
    rc = script.main(["--config", str(ROOT / "configs" / "smollm2-arith.yaml"), "--steps", "2", "--timing-warmup",
                      "1", "--out", str(tmp_path), "--fresh-drafter", "--seeds", "3", "4", "--hold-policy", "--",
                      *keys])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "rl.lr=0" in out and "rl.seed=3" in out and "rl.seed=4" in out
    for seed in (3, 4):
        for name in ("rl-off", "rl-auto"):
            records = [json.loads(x) for x in (tmp_path / "runs" / f"{name}-s{seed}" / "metrics.jsonl").read_text()
                       .splitlines()]  # fmt: skip
            assert [r["step"] for r in records] == [0, 1] and "heldout_accuracy" not in records[0]
        assert f"| rl-auto-s{seed} | 2 |" in (tmp_path / f"seed{seed}" / "compare.md").read_text()
    seeds = (tmp_path / "seeds.md").read_text()
    assert "| 3 | 2 |" in seeds and "| 4 | 2 |" in seeds and "reward gap, rl-auto - rl-off, over 2 seeds" in seeds
    assert (tmp_path / "seeds.png").stat().st_size > 1000
