"""reasoning-gym as a task source (`task.kind: reasoning_gym`, train/rl/reasoning_gym_task.py): the final
answer read as text, the config's checks, the one-line error without the package, and, where the optional
package is installed, prompts, the dataset's own verifier, held-out problems of another seed and one RL step
on the tiny model."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.runs import metrics, policy_weights, tiny_config
from tlt_rt.config import DEFAULT_INSTRUCTION, ConfigError, TLTConfig, load_config
from tlt_rt.train.__main__ import main as train_main
from tlt_rt.train.rl.reward import extract_answer_text

RG = ["task.kind=reasoning_gym", "task.rg_dataset=chain_sum"]
SMALL = ["task.rg_config.min_terms=2", "task.rg_config.max_terms=2", "task.rg_config.max_digits=1"]


@pytest.fixture(scope="module")  # module scope: set up, and so skipped, before Ray and the tiny model
def rg():
    return pytest.importorskip("reasoning_gym")


# ----------------------------------------------------------------------------- without the package
@pytest.mark.parametrize("text, want", [
    ("so <answer>apple, pear</answer> and <answer> 3, 4 </answer>", "3, 4"),  # the last tag
    ("<answer>7</answer> then \\boxed{9}", "7"),  # reasoning-gym's tags before \boxed
    ("<answer> It rains. </answer>", "It rains."),  # a tag's content as reasoning-gym reads it
    ("hence \\boxed{\\text{ab}c}.", "abc"),
    ("The answer is: **banana, cherry**.\nThanks", "banana, cherry"),
    ("answer = $x^2 + 1$", "x^2 + 1"),
    ("first 3, then 1,234 apples", "1234"),  # no marker: the last number, as `extract_answer` reads it
    ("<answer>unclosed 5", "5"),
    ("no answer here", None),
    ("", None),
])  # fmt: skip
def test_answer_text_is_read_in_order(text, want):
    assert extract_answer_text(text) == want


def test_answer_text_stays_linear_on_runaway_text():
    import time

    t0 = time.perf_counter()
    for text in ("answer" + " " * 100_000 + "x", "<answer>" * 20_000, "\\boxed{" * 20_000):
        extract_answer_text(text)
    assert time.perf_counter() - t0 < 2.0


def test_config_reads_the_options_and_asks_for_any_final_answer():
    cfg = load_config(TLTConfig, overrides=[*RG, *SMALL])
    assert cfg.task.rg_config == {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    assert cfg.task.instruction != DEFAULT_INSTRUCTION and "final answer" in cfg.task.instruction
    assert load_config(TLTConfig, overrides=[*RG, "task.instruction=Be brief."]).task.instruction == "Be brief."


@pytest.mark.parametrize("bad, key", [
    (["task.kind=reasoning_gym"], "task.rg_dataset"),
    ([*RG, "task.rg_config.seed=3"], "task.rg_config"),
    ([*RG, "task.reward=math_verify"], "task.reward"),
    ([*RG, "task.rg_size=0"], "task.rg_size"),
])  # fmt: skip
def test_config_refuses(bad, key):
    with pytest.raises(ConfigError, match=key):
        load_config(TLTConfig, overrides=bad)


def test_missing_package_is_one_line_config_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    assert train_main(["--dry-run", *RG]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "task.kind" in err and "pip install 'tlt_rt[reasoning]'" in err


# ----------------------------------------------------------------------------- with it
def test_prompts_answers_and_the_datasets_verifier(rg):
    from tlt_rt.models.default import load_tokenizer
    from tlt_rt.train.rl.data import ReasoningGymTask, format_prompt_text

    task = ReasoningGymTask("chain_sum", {"min_terms": 2, "max_terms": 2, "max_digits": 1}, seed=5)
    problems = task.sample(4, start=10)
    assert [p.question for p in problems] == [p.question for p in task.sample(4, start=10)]  # pure in (seed, i)
    dataset = rg.create_dataset("chain_sum", min_terms=2, max_terms=2, max_digits=1, seed=5, size=100_000)
    for p in problems:
        entry = dataset[p.meta["index"]]
        assert (p.question, p.answer) == (entry["question"], entry["answer"])
        assert task.score(f"Adding up, the answer is {p.answer}.", p) == 1.0
        assert task.score(f"So \\boxed{{{p.answer}}}", p) == 1.0
        assert task.score(f"<answer>{p.answer}</answer>", p) == 1.0
        assert task.score(f"The answer is {int(p.answer) + 1}.", p) < 1.0
        assert task.score("I do not know.", p) == 0.0
    text = format_prompt_text(problems[0], load_tokenizer(None), instruction="End with the answer.")
    assert problems[0].question in text and "End with the answer." in text
    # a dataset whose verifier gives partial credit: a wrong answer that contains the right one scores between
    gcd = ReasoningGymTask("gcd", {"max_value": 50}, seed=1)
    p = gcd.problem(0)
    assert gcd.score(f"The answer is {p.answer}.", p) == 1.0
    assert 0.0 < gcd.score(f"The answer is {p.answer}9.", p) < 1.0


def test_bad_dataset_name_and_options(rg):
    from tlt_rt.train.rl.reasoning_gym_task import ReasoningGymTask, UnknownDatasetError

    with pytest.raises(UnknownDatasetError, match="did you mean 'chain_sum'"):
        ReasoningGymTask("chain_sums")
    with pytest.raises(ValueError, match="no option 'max_term'"):
        ReasoningGymTask("chain_sum", {"max_term": 3})
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        ReasoningGymTask("chain_sum", {"min_terms": 3, "max_terms": 2})
    assert train_main(["--dry-run", "task.kind=reasoning_gym", "task.rg_dataset=chain_sums"]) == 2


def test_held_out_problems_come_from_another_seed_and_the_stream_resumes(rg):
    from tlt_rt.train import heldout
    from tlt_rt.train.loop import make_source
    from tlt_rt.train.rl.data import PromptSource

    cfg = load_config(TLTConfig, overrides=[*RG, "task.seed=3", "logging.eval_every=5", "logging.eval_prompts=30"])
    held = heldout.held_out_problems(cfg)
    assert len(held) == 30 and {p.meta["seed"] for p in held} == {3 + cfg.task.rg_size}
    source = make_source(cfg)
    trained = [p for _ in range(10) for p in source.next_batch()]
    assert {p.meta["seed"] for p in trained} == {3}
    assert not {p.question for p in trained} & {p.question for p in held}
    # entry i of seed s is entry i + k of seed s - k: the training indices stop short of the held-out seed
    assert max(p.meta["index"] for p in trained) < cfg.task.rg_size
    state = source.state_dict()
    again = PromptSource(source.source, cfg.rl.prompts_per_step, seed=cfg.task.seed)
    again.load_state_dict(state)
    assert [p.question for p in again.next_batch()] == [p.question for p in source.next_batch()]


def test_one_rl_step_on_the_tiny_model(rg, ray_cluster, tiny, tmp_path):
    from tlt_rt.train.loop import train
    from tlt_rt.train.rl import checkpoint as ckpt

    # gcd of numbers up to 3 is 1, 2 or 3; the tiny policy writes 1s and 2s, and the dataset's verifier gives
    # partial credit to answers that contain the right one ("21" for 1): rewards differ within groups
    cfg = tiny_config(tiny, tmp_path, "rg", "rl.steps=1", "cluster.num_workers=1", "task.kind=reasoning_gym",
                      "task.rg_dataset=gcd", "task.rg_config.max_value=3", "task.rg_size=64",
                      "logging.eval_every=1", "logging.eval_prompts=2")  # fmt: skip
    records = train(cfg)
    assert records[0]["policy_version"] == 1 and records[0]["samples_trained"] > 0
    assert 0.0 < records[0]["reward_mean"] < 1.0
    start, got = policy_weights(tiny / "policy"), policy_weights(ckpt.latest_checkpoint(tmp_path / "rg") / "policy")
    assert any(not torch.equal(got[k], start[k]) for k in got), "the policy did not change"
    logged = metrics(tmp_path / "rg")[0]
    assert logged["heldout_n"] == 2 and 0.0 <= logged["heldout_reward_end"] <= 1.0
