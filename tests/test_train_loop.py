"""The RL loop end to end on Ray (CPU): SmolLM2 for two steps, exact resume, worker-failure recovery,
dry runs of every shipped config, and the loop's small helpers."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import assert_same_run, metrics, policy_weights, tiny_config
from tlt_rt.config import ConfigError, TLTConfig, load_config
from tlt_rt.train.__main__ import main as train_main
from tlt_rt.train.batching import build_minibatches, share_seed, split_even, work_shares
from tlt_rt.train.drafter.tail import TAIL_SWITCH_INTERVAL_S, Pacer, TailTrainer, sm_partition, tail_training_on
from tlt_rt.train.loop import RunExistsError, train
from tlt_rt.train.rl import checkpoint as ckpt
from tlt_rt.train.rl.learner import LearnSample

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def reference_run(ray_cluster, tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    train(tiny_config(tiny, out, "reference"))
    return out / "reference"


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_smollm2_two_steps_train_policy_and_drafter(ray_cluster, tmp_path):
    from tlt_rt.models.loader import resolve_model_path
    from tlt_rt.report import write_report

    # plain decoding keeps the samples (hence the learning signal) the same from run to run; the loop's
    # speculative paths run in the tiny-model tests below
    cfg = load_config(TLTConfig, ROOT / "configs" / "smollm2-arith.yaml", [
        "name=e2e", f"output_dir={tmp_path}", "rl.steps=2", "rl.prompts_per_step=3", "rl.group_size=4",
        "rollout.max_new_tokens=16", "rollout.max_batch=4", "rollout.speculative=off",
        "drafter.batch_tokens=64",
        "rl.micro_batch=6", "rl.checkpoint_every=2", "tensorboard=false",
    ])  # fmt: skip
    records = train(cfg)
    run = tmp_path / "e2e"
    assert [r["step"] for r in records] == [0, 1] and [r["step"] for r in metrics(run)] == [0, 1]
    # the worker with one prompt (of three) finishes early and trains the drafter while the other generates
    assert sum(r["spot_steps"] for r in records) > 0
    assert sum(r["harvested_worker_seconds"] for r in records) > 0
    for r in records:  # the workers' tail: the first worker done to the last
        ends = r["worker_rollout_seconds"]
        assert len(ends) == 2 and r["worker_gap_seconds"] == max(ends) - min(ends)
        assert max(ends) <= r["rollout_seconds"] + 1e-6
    assert max(r["worker_gap_seconds"] for r in records) > 0
    assert all(r["drafter_loss"] is not None for r in records if r["spot_steps"])
    assert sum(r["samples_trained"] for r in records) > 0 and records[-1]["policy_version"] >= 1
    for key in ("reward_mean", "accuracy", "response_len_p90", "tail_share", "sd_share", "strategy_use",
                "tokens_per_second", "learner_seconds", "idle_worker_seconds"):  # fmt: skip
        assert key in records[0], key
    last = ckpt.latest_checkpoint(run)
    assert last is not None and last.name == "step_000002"
    for part in ("policy/model.safetensors", "policy/config.json", "policy/tokenizer.json", "learner.pt",
                 "drafter/drafter.safetensors", "worker_0.pt", "worker_1.pt", "state.json"):  # fmt: skip
        assert (last / part).is_file(), part
    before, after = policy_weights(resolve_model_path(None)), policy_weights(last / "policy")
    assert any(not torch.equal(before[k], after[k]) for k in after), "the policy did not change"
    # rank 0 (two prompts) never idled, so its saved drafter differs from the initial one only by the merge
    fresh = _fresh_drafter(resolve_model_path(None) / "config.json", cfg.rl.seed).state_dict()
    merged = load_file(str(last / "drafter" / "drafter.safetensors"))
    assert records[0]["spot_workers"] == 1 and any(not torch.equal(fresh[k], merged[k]) for k in merged)
    timelines = [json.loads(x) for x in (run / "timelines.jsonl").read_text().splitlines()]
    kinds = {bar[0] for bars in timelines[-1]["workers"].values() for bar in bars}
    assert {"generating", "drafter"} <= kinds
    assert (write_report(run).parent / "timeline.png").is_file()


def _fresh_drafter(config_json: Path, seed: int):
    """The drafter a worker starts from: the same seed, drawn before anything else touches the RNG."""
    from tlt_rt.models.arch import ArchConfig
    from tlt_rt.models.drafter import Drafter
    from tlt_rt.models.llama import CausalLM

    arch = ArchConfig.from_file(config_json)
    with torch.device("meta"):
        target = CausalLM(arch)
    torch.manual_seed(seed)
    return Drafter(arch, target)


def test_resume_equals_uninterrupted_run(reference_run, tiny, tmp_path):
    assert metrics(reference_run)[-1]["samples_trained"] > 0
    train(tiny_config(tiny, tmp_path, "split", "rl.steps=1"))
    with pytest.raises(RunExistsError, match="resume=true"):
        train(tiny_config(tiny, tmp_path, "split", "rl.steps=2"))
    train(tiny_config(tiny, tmp_path, "split", "rl.steps=2", "resume=true"))
    assert_same_run(reference_run, tmp_path / "split")
    opt_a = torch.load(ckpt.latest_checkpoint(reference_run) / "learner.pt", weights_only=False)
    opt_b = torch.load(ckpt.latest_checkpoint(tmp_path / "split") / "learner.pt", weights_only=False)
    assert opt_a["version"] == opt_b["version"] == 2
    for sa, sb in zip(opt_a["optimizer"]["state"].values(), opt_b["optimizer"]["state"].values(), strict=True):
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


@pytest.mark.parametrize("where", ["rollout:1:1", "learn:0:1"])
def test_dead_worker_is_replaced_and_its_share_redone(reference_run, tiny, tmp_path, where):
    records = train(tiny_config(tiny, tmp_path, "faulty", f"cluster.debug_fail={where}"))
    phase, rank, step = where.split(":")
    assert (tmp_path / "faulty" / f".debug_fail.{phase}.{rank}.{step}").is_file()  # it did die
    assert records[-1]["worker_restarts"] == 1
    # the redone share and update give exactly the uninterrupted run
    assert_same_run(reference_run, tmp_path / "faulty")


def test_fsdp_learner_gives_the_unsharded_update(reference_run, tiny, tmp_path):
    train(tiny_config(tiny, tmp_path, "fsdp", "rl.steps=1", "rl.learner_shard=fsdp"))
    want = policy_weights(ckpt.list_checkpoints(reference_run)[0] / "policy")  # the reference after step 1
    got = policy_weights(ckpt.latest_checkpoint(tmp_path / "fsdp") / "policy")
    start = policy_weights(tiny / "policy")
    assert got.keys() == want.keys() and any(not torch.equal(got[k], start[k]) for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=k)
    assert {k: metrics(tmp_path / "fsdp")[0][k] for k in ("samples_trained", "policy_version")} == {
        k: metrics(reference_run)[0][k] for k in ("samples_trained", "policy_version")
    }


def test_tensor_parallel_engine_steps_and_learns(ray_cluster, tiny, tmp_path):
    # one DP replica of two TP ranks (two processes), speculative decoding on: the lockstep engine; the drafter trains
    # online over a reduced vocabulary that rank 0 rebuilds from its answers, and after each merge the ranks check
    # that they serve the same drafter (rank 1 kept its first vocabulary and the engines left lockstep, before); the
    # serving drafter is cut over the ranks like the target, so each merge pushes the trained replica into shards
    records = train(tiny_config(tiny, tmp_path, "tp2", "rl.steps=3", "cluster.num_workers=1",
                                "cluster.tensor_parallel=2", "cluster.drafter_tp=shard",
                                "drafter.train_online=true", "drafter.batch_tokens=32",
                                "drafter.draft_vocab=16", "drafter.tail_fraction=0.5", "rollout.max_new_tokens=48",
                                "rl.prompts_per_step=2"))  # fmt: skip
    assert len(records) == 3 and records[0]["policy_version"] == 1 and records[0]["samples_trained"] > 0
    assert all(r["sd_share"] > 0 for r in records)
    assert sum(r["spot_steps"] for r in records) > 0  # the drafter trained, so the merges after it checked the ranks
    start, got = policy_weights(tiny / "policy"), policy_weights(ckpt.latest_checkpoint(tmp_path / "tp2") / "policy")
    assert any(not torch.equal(got[k], start[k]) for k in got), "the policy did not change"


def test_single_worker_trains_the_drafter_in_its_own_tail(ray_cluster, tiny, tmp_path):
    records = train(tiny_config(
        tiny, tmp_path, "alone", "cluster.num_workers=1", "rl.prompts_per_step=2", "rollout.max_new_tokens=48",
        "rollout.speculative=off", "drafter.train_online=true", "drafter.tail_fraction=0.5", "drafter.batch_tokens=32",
    ))  # fmt: skip
    # step 0 fills the buffer; step 1 trains while its last sequences finish
    assert records[0]["spot_steps"] == 0 and records[1]["spot_steps"] > 0
    assert records[1]["harvested_worker_seconds"] == 0  # tail training overlaps generation: nothing idle
    bars = json.loads((tmp_path / "alone" / "timelines.jsonl").read_text().splitlines()[-1])["workers"]["0"]
    gen_end = max(b for k, _, b in bars if k == "generating")
    assert any(k == "drafter" and a < gen_end for k, a, _ in bars)


def test_worker_in_process_rollout_train_merge_learn(tiny, tmp_path):
    from tlt_rt.config import to_dict
    from tlt_rt.train.cluster.worker import Worker
    from tlt_rt.train.rl.learner import MiniBatch

    cfg = tiny_config(tiny, tmp_path, "w", "drafter.train_online=true", "drafter.batch_tokens=32",
                      "logging.profile_learner_step=0")  # fmt: skip
    w = Worker(0, 1, to_dict(cfg), str(tmp_path / "w"))
    params = dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=3)
    res = w.rollout(0, [[1, 2, 3], [4, 5]], params)
    assert len(res.samples) == 4 and res.timeline and w.drafter_role.buffer.num_tokens > 0
    w.stop_drafter(7)  # a stop that arrives before its training call still stops it
    assert w.train_drafter(7).steps == 0
    box = {}
    t = threading.Thread(target=lambda: box.update(vars(w.train_drafter(1))))
    t.start()
    while w.drafter_role.trainer.steps < 2:
        t.join(0.01)
    w.stop_drafter(1)
    t.join()
    assert box["steps"] >= 2 and box["end"] >= box["start"]
    w.merge_drafter(box["steps"], box["steps"])
    served = w.rollout_role.engine.drafter_runner.drafter.state_dict()
    for k, v in w.drafter_role.replica.state_dict().items():
        assert torch.equal(served[k], v.to(served[k].dtype)), k
    toks, lps = res.samples[0].token_ids, res.samples[0].logprobs
    out = w.learn(0, [MiniBatch([LearnSample([1, 2, 3], toks, lps, 1.0)], len(toks), 1)])
    assert out.version == 1 and out.optimizer_steps == 1
    # logging.profile_learner_step: the update of step 0 profiled, its host operators named (no kernels on a CPU)
    prof = (tmp_path / "w" / "profile" / "learner-step0-rank0.txt").read_text()
    assert "learner update, step 0, rank 0" in prof and "aten::" in prof and "by kind" not in prof
    w.learn(1, [MiniBatch([LearnSample([1, 2, 3], toks, lps, 1.0)], len(toks), 1)])
    assert not (tmp_path / "w" / "profile" / "learner-step1-rank0.txt").exists()
    other = Worker(1, 1, to_dict(cfg), str(tmp_path / "w"))
    other.import_state(w.export_state())
    for k, v in w.learner_role.model.state_dict().items():
        assert torch.equal(other.learner_role.model.state_dict()[k], v), k
    assert other.learner_role.version == 2


def test_a_configured_draft_vocab_is_sized_before_capture_and_rebuilt_in_place(tiny, tmp_path):
    """drafter.draft_vocab gives the serving drafter its reduced head before the engine captures: the
    vocabulary the trainer rebuilds from the first rollout is then copied into the same tensors."""
    from tlt_rt.config import to_dict
    from tlt_rt.train.cluster.worker import Worker

    cfg = tiny_config(tiny, tmp_path, "v", "drafter.train_online=true", "drafter.batch_tokens=32",
                      "drafter.draft_vocab=24")  # fmt: skip
    w = Worker(0, 1, to_dict(cfg), str(tmp_path / "v"))
    serving = w.drafter_role.serving
    assert serving.draft_vocab_size == 24 and w.drafter_role.replica.draft_vocab_size == 24
    assert set(serving.arch.eos_token_ids) <= set(serving.d2t.tolist())
    d2t, head = serving.d2t, serving.draft_head
    placeholder = d2t.clone()
    w.rollout(0, [[1, 2, 3], [4, 5]], dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=6, seed=3))
    t = threading.Thread(target=w.train_drafter, args=(1,))
    t.start()
    while w.drafter_role.trainer.steps < 1:
        t.join(0.01)
    w.stop_drafter(1)
    t.join()
    assert not torch.equal(w.drafter_role.replica.d2t, placeholder)  # rebuilt from the rollout's tokens
    w.merge_drafter(w.drafter_role.trainer.steps, w.drafter_role.trainer.steps)
    assert serving.d2t is d2t and serving.draft_head is head  # the same tensors, new contents
    assert torch.equal(serving.d2t, w.drafter_role.replica.d2t.to(d2t.device))
    torch.testing.assert_close(serving.draft_head, serving.lm_head.weight.detach()[serving.d2t])


def test_a_lone_worker_that_dies_restarts_from_the_step_checkpoint(ray_cluster, tiny, tmp_path):
    records = train(tiny_config(tiny, tmp_path, "lone", "cluster.num_workers=1", "cluster.debug_fail=rollout:0:1"))
    assert (tmp_path / "lone" / ".debug_fail.rollout.0.1").is_file()
    assert records[-1]["worker_restarts"] == 1 and records[-1]["policy_version"] == 2


# ----------------------------------------------------------------------------- dry runs
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_dry_run_every_config(path, capsys):
    if load_config(TLTConfig, path).task.kind == "reasoning_gym":
        pytest.importorskip("reasoning_gym")  # an optional extra: tlt_rt[reasoning]
    assert train_main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "memory per" in out and "rollout phase:" in out and "learner phase:" in out


def test_shipped_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"smollm2-arith", "smollm2-arith-gpu", "qwen2.5-7b", "qwen2.5-32b",
                                         "llama70b"}  # fmt: skip


def test_dry_run_errors(capsys, tmp_path):
    assert train_main(["--dry-run", "model.path=/nowhere/model"]) == 2
    assert "model.arch" in capsys.readouterr().err
    assert train_main(["--dry-run", "rl.group_sise=4"]) == 2
    assert "did you mean 'rl.group_size'" in capsys.readouterr().err
    assert train_main(["--dry-run", "model.path=/nowhere/model", "model.arch=qwen2.5-7b"]) == 0
    assert train_main(["--dry-run", "--bogus"]) == 2


# ----------------------------------------------------------------------------- helpers
def test_split_even_and_share_seed():
    assert split_even(5, 2) == [(0, 3), (3, 5)]
    assert split_even(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert share_seed(0, 3, 2) == share_seed(0, 3, 2) != share_seed(0, 3, 0)


def test_work_shares_by_prompts_and_by_samples():
    assert work_shares(5, 8, 2) == ([(0, 3), (3, 5)], [(0, 0), (3, 0)], [8, 8])  # today's shares and seeds
    shares, origins, answers = work_shares(5, 8, 2, "samples")
    assert shares == [(0, 5), (0, 5)] and answers == [4, 4]  # every prompt, half of each group
    assert [first for _, first in origins] == [0, 4]
    keys = [key for key, _ in origins]  # the seed keys: distinct, and never a prompt index
    assert len({share_seed(0, 1, k) for k in keys}) == 2 and all(k < 0 for k in keys)
    with pytest.raises(ValueError, match="divide"):
        work_shares(5, 6, 4, "samples")
    with pytest.raises(ValueError, match="split"):
        work_shares(5, 8, 2, "rows")


def test_samples_split_fills_every_answer_of_every_group(ray_cluster, tiny, tmp_path):
    keys = ("rl.steps=1", "cluster.num_workers=2", "cluster.split=samples", "rollout.speculative=off")
    records = train(tiny_config(tiny, tmp_path, "spread", *keys, "rollout.max_new_tokens=6"))
    r = records[0]
    assert len(r["response_lengths"]) == 3 * 4 and min(r["response_lengths"]) > 0  # each slot filled once
    assert len(r["worker_rollout_seconds"]) == 2
    with pytest.raises(ConfigError, match="cluster.split"):
        tiny_config(tiny, tmp_path, "odd", "cluster.num_workers=2", "cluster.split=samples", "rl.group_size=3")


def test_build_minibatches_global_counts_and_balance():
    samples = [LearnSample([1] * p, [2] * r, [0.0] * r, 1.0) for p, r in ((3, 5), (2, 1), (4, 4), (1, 2), (2, 2))]
    per_worker = build_minibatches(samples, num_minibatches=2, num_workers=2)
    assert [len(mbs) for mbs in per_worker] == [2, 2]
    for m in range(2):
        parts = [per_worker[r][m] for r in range(2)]
        assert parts[0].num_tokens == parts[1].num_tokens == sum(len(s.response) for p in parts for s in p.samples)
        assert parts[0].num_seqs == sum(len(p.samples) for p in parts)
    assert sum(len(per_worker[r][m].samples) for r in range(2) for m in range(2)) == len(samples)


def test_tail_trainer_starts_in_the_tail_and_stops():
    class FakeTrainer:
        device = torch.device("cpu")

        def __init__(self):
            self.started = threading.Event()

        def train(self, stop, max_steps=None, after_step=None, micro_tokens=0):
            self.started.set()
            stop.wait()
            return {"steps": 3, "loss": 1.0, "top1": 0.5}

    class FakeEngine:
        timeline = [{"kind": "prefill", "running": 8}, {"kind": "decode", "running": 8}]

    eng, tr = FakeEngine(), FakeTrainer()
    tail = TailTrainer(eng, tr, first_entry=0, capacity=8, fraction=0.25, max_steps=None)
    before = sys.getswitchinterval()
    tail.start()
    # while the trainer may run, the engine's thread gets the GIL back quickly
    assert sys.getswitchinterval() == pytest.approx(min(before, TAIL_SWITCH_INTERVAL_S)) and before > 1e-3
    assert not tr.started.wait(0.1)  # 8 of 8 running: not the tail
    eng.timeline.append({"kind": "decode", "running": 1})
    assert tr.started.wait(5)
    out = tail.finish()
    assert out.steps == 3 and out.where == "tail" and out.end >= out.start
    assert sys.getswitchinterval() == before


def test_tail_trainer_paces_its_steps_to_the_duty():
    """With tail_duty 0.25 the pacer idles three times each step's length after it (a fake clock: steps of 20
    and 40 ms ask for 60 and 120 ms), so the trainer keeps the device busy a quarter of the tail; the stop ends
    an idle spell at once; the tail trainer hands its pacer to every training step."""
    clock = [0.0]

    class Stop:  # a stop event that records the pauses asked of it and lets the fake clock run through them
        def __init__(self):
            self.asked, self.stopped = [], False

        def wait(self, seconds):
            self.asked.append(seconds)
            if not self.stopped:
                clock[0] += seconds
            return self.stopped

    stop = Stop()
    pacer = Pacer(0.25, stop, clock=lambda: clock[0])
    for step in (0.02, 0.04):
        clock[0] += step  # a training step
        pacer()
    assert stop.asked == pytest.approx([0.06, 0.12]) and pacer.idle == pytest.approx(0.18)
    assert (clock[0] - pacer.idle) / clock[0] == pytest.approx(0.25)  # busy a quarter of the span
    Pacer(1.0, stop, clock=lambda: clock[0])()  # duty 1: back to back, no pause asked
    assert len(stop.asked) == 2
    stop.stopped = True
    quick = Pacer(0.01, stop, clock=lambda: clock[0])  # would idle 99x the step
    clock[0] += 0.05
    quick()
    assert stop.asked[-1] == pytest.approx(4.95) and clock[0] == pytest.approx(0.29)  # asked, not waited
    with pytest.raises(ValueError, match="duty"):
        Pacer(0.0, threading.Event())

    class SteppingTrainer:
        device = torch.device("cpu")

        def __init__(self):
            self.after = []

        def train(self, stop, max_steps=None, after_step=None, micro_tokens=0):
            for _ in range(max_steps):
                self.after.append(after_step)
            return {"steps": max_steps, "loss": 1.0, "top1": 0.5}

    class TailEngine:
        timeline = [{"kind": "decode", "running": 1}]

    tr = SteppingTrainer()
    tail = TailTrainer(TailEngine(), tr, first_entry=0, capacity=8, fraction=0.5, max_steps=4, duty=0.25,
                       micro_tokens=512)  # fmt: skip
    tail.start()
    tail._thread.join(5)
    out = tail.finish()
    assert out.steps == 4 and tr.after == [tail.pacer] * 4 and tail.pacer.duty == 0.25 and tail.micro_tokens == 512


def test_tail_sms_partition_and_config():
    assert sm_partition(16, 132) == 16
    assert sm_partition(10, 132) == 16  # rounded up to the granularity of 8
    assert sm_partition(0, 132) == 0 and sm_partition(132, 132) == 0 and sm_partition(130, 132) == 0
    cfg = load_config(TLTConfig, overrides=["drafter.tail_sms=24", "drafter.tail_duty=0.5"])
    assert cfg.drafter.tail_sms == 24 and cfg.drafter.tail_duty == 0.5
    for bad in ("drafter.tail_duty=0", "drafter.tail_duty=1.5", "drafter.tail_sms=-1"):
        with pytest.raises(Exception, match="tail_"):
            load_config(TLTConfig, overrides=[bad])


def test_tail_training_switch():
    cfg = load_config(TLTConfig, overrides=["cluster.num_workers=1"])
    assert tail_training_on(cfg)
    assert not tail_training_on(load_config(TLTConfig))
    assert tail_training_on(load_config(TLTConfig, overrides=["drafter.tail_training=on"]))
    assert not tail_training_on(
        load_config(TLTConfig, overrides=["cluster.num_workers=1", "drafter.train_online=false"])
    )


def test_checkpoint_commit_and_prune(tmp_path):
    for step in (1, 2, 3):
        tmp = ckpt.staging_dir(tmp_path, step)
        (tmp / "x").write_text(str(step))
        ckpt.commit(tmp, tmp_path, step, {"step": step}, keep=2)
    (ckpt.checkpoint_root(tmp_path) / "step_000009").mkdir()  # no COMPLETE marker: ignored
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    assert ckpt.load_state(ckpt.latest_checkpoint(tmp_path)) == {"step": 3}


def test_a_collective_that_fails_on_live_workers_raises_instead_of_retrying(ray_cluster):
    import ray

    from tlt_rt.train.cluster.pool import WorkerPool

    @ray.remote
    class Failing:
        def __init__(self):
            self.calls = 0

        def learn(self, step, minibatches):
            self.calls += 1
            raise MemoryError("CUDA out of memory (simulated)")

        def count(self):
            return self.calls

    pool = WorkerPool.__new__(WorkerPool)  # only what collective() reads
    pool.workers, pool.size, pool._dirty, pool.version = [Failing.remote()], 1, False, 0
    with pytest.raises(ray.exceptions.RayTaskError, match="out of memory"):
        pool.collective("learn", [(0, [1, 2])], resume_from=0)
    assert ray.get(pool.workers[0].count.remote()) == 1


def test_time_limit_stops_after_a_step_with_a_checkpoint(ray_cluster, tiny, tmp_path):
    records = train(tiny_config(tiny, tmp_path, "boxed", "rl.steps=5", "rl.time_limit_s=0.001",
                                "cluster.num_workers=1", f"task.eval_path={tiny / 'data.jsonl'}",
                                "logging.eval_every=3", "logging.eval_prompts=2"))  # fmt: skip
    assert [r["step"] for r in records] == [0]
    assert ckpt.latest_checkpoint(tmp_path / "boxed").name == "step_000001"
    # the held-out evaluation after the last update runs when the time limit ends the run too
    logged = metrics(tmp_path / "boxed")
    assert "heldout_accuracy" in logged[0] and 0.0 <= logged[-1]["heldout_accuracy_end"] <= 1.0


def test_dry_run_counts_the_kv_cache_the_engine_will_take(capsys):
    import re

    def kv_gib(*keys):
        assert train_main([str(ROOT / "configs" / "smollm2-tail-gpu.yaml"), "--dry-run", *keys]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "KV cache" in x)
        return line, float(re.findall(r"([\d.]+) GiB", line)[-1])

    # without rollout.num_blocks the engine takes what max_batch sequences of the full context can fill (128 x
    # 133 blocks of 16 tokens, the drafter's layer beside the target's 30) ...
    per_token = 2 * 31 * 3 * 64 * 2
    line, gib = kv_gib()
    assert "max_batch x full context" in line and gib == pytest.approx(128 * 133 * 16 * per_token / 2**30, abs=0.01)
    # ... at most half of what is free when it starts: ~38 of 80 GiB
    line, gib = kv_gib("rollout.max_batch=512", "model.max_context=8192")
    assert "half the free GPU memory" in line and 37 < gib < 40
    line, gib = kv_gib("rollout.num_blocks=1024")  # 16k tokens of SmolLM2's 30 layers x 3 KV heads x 64
    assert "rollout.num_blocks" in line and gib == pytest.approx(1024 * 16 * 2 * 30 * 3 * 64 * 2 / 2**30, abs=0.01)


def test_rl_lr_0_holds_the_policy_still(ray_cluster, tiny, tmp_path):
    """rl.lr=0: every step still computes its loss and gradients, and the saved policy is the one it started from
    (a sampler comparison's setting, benchmarks/e2e_rl.py --hold-policy)."""
    records = train(tiny_config(tiny, tmp_path, "held", "cluster.num_workers=1", "rl.lr=0", "rl.steps=2",
                                "rl.checkpoint_every=2", "rollout.speculative=off"))  # fmt: skip
    assert all(r["grad_norm"] > 0 and r["loss"] != 0 for r in records)
    start, end = policy_weights(tiny / "policy"), policy_weights(ckpt.latest_checkpoint(tmp_path / "held") / "policy")
    assert start.keys() == end.keys() and all(torch.equal(start[k], end[k]) for k in start)
    with pytest.raises(ConfigError, match="rl.lr"):
        tiny_config(tiny, tmp_path, "neg", "rl.lr=-1e-6")
