"""Four data-parallel workers on the CPU, as the 4-GPU config runs them: every worker every prompt with a share of its
answers (cluster.split: samples), the learner's gradients summed over four ranks, a worker done with its share
training the drafter, the replicas merged before the next rollout."""

from __future__ import annotations

from tests.helpers.runs import assert_same_run, tiny_config
from tlt_rt.train.loop import train


def test_four_workers_split_samples_and_train_the_drafter_when_idle(ray_cluster, tiny, tmp_path):
    keys = ("rl.steps=2", "cluster.num_workers=4", "cluster.split=samples", "rl.group_size=4", "rl.micro_batch=4",
            "rollout.max_new_tokens=12", "rollout.speculative=auto", "drafter.train_online=true",
            "drafter.batch_tokens=32")  # fmt: skip
    records = train(tiny_config(tiny, tmp_path, "four", *keys))
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert len(r["response_lengths"]) == 3 * 4 and min(r["response_lengths"]) > 0  # every answer, once
        ends = r["worker_rollout_seconds"]
        assert len(ends) == 4 and r["worker_gap_seconds"] == max(ends) - min(ends)
    assert records[-1]["policy_version"] >= 1
    # the workers done first trained the drafter while the last one finished its share
    assert sum(r["spot_steps"] for r in records) > 0 and max(r["spot_workers"] for r in records) >= 1
    assert sum(r["harvested_worker_seconds"] for r in records) > 0


def test_idle_workers_training_the_drafter_leave_the_learning_bit_identical(ray_cluster, tiny, tmp_path):
    """Plain decoding on four workers with and without online drafter training: the same answers, so the same
    updates. The idle workers' drafter steps and the replicas' merge (a collective in the group the gradients
    are summed in) leave every step's outcome and the final policy bit-identical."""
    keys = ("rl.steps=3", "cluster.num_workers=4", "cluster.split=samples", "rl.group_size=4", "rl.micro_batch=4",
            "rollout.max_new_tokens=12", "rollout.speculative=off", "drafter.batch_tokens=32",
            "rl.checkpoint_every=3")  # fmt: skip
    train(tiny_config(tiny, tmp_path, "plain", *keys, "drafter.train_online=false"))
    trained = train(tiny_config(tiny, tmp_path, "trained", *keys, "drafter.train_online=true"))
    assert sum(r["spot_steps"] for r in trained) > 0
    assert_same_run(tmp_path / "plain", tmp_path / "trained")
