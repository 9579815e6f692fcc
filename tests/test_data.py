"""The default RL task: generated problems, prompt formatting, dataset files, and the resumable stream."""

from __future__ import annotations

import ast
import json
import operator
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tlt_rt.train.rl.data import (
    ArithmeticTask,
    DatasetError,
    Problem,
    PromptSource,
    format_prompt,
    format_prompt_text,
    load_dataset_file,
    reference_answer,
)
from tlt_rt.train.rl.reward import reward

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(expression: str) -> Fraction:
    """Evaluate "+-*/" arithmetic exactly with Fractions, independent of the generator's own chain."""

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        return Fraction(node.value)

    return walk(ast.parse(expression, mode="eval").body)


# ---- the generator --------------------------------------------------------------------------------------


@given(
    seed=st.integers(0, 10**6),
    index=st.integers(0, 10**9),
    digits=st.integers(1, 3),
    num_ops=st.integers(1, 4),
    words=st.booleans(),
)
def test_problem_is_pure_and_answer_is_exact(seed, index, digits, num_ops, words):
    task = ArithmeticTask(digits=digits, num_ops=num_ops, word_problems=words, seed=seed)
    p = task.problem(index)
    assert p == ArithmeticTask(digits=digits, num_ops=num_ops, word_problems=words, seed=seed).problem(index)
    value = _evaluate(p.meta["expression"])
    assert value.denominator == 1 and value >= 1
    assert p.answer == str(int(value))
    assert len(p.meta["ops"]) == num_ops
    lo = 1 if digits == 1 else 10 ** (digits - 1)
    assert all(lo <= n < 10**digits for n in p.meta["operands"])
    # Every step stays positive, so no story counts negative apples.
    running = p.meta["operands"][0]
    for op, n in zip(p.meta["ops"], p.meta["operands"][1:], strict=True):
        running = _evaluate(f"{running} {op} {n}")
        assert running.denominator == 1 and running >= 1


def test_bare_question_evaluates_to_the_answer():
    for p in ArithmeticTask(word_problems=False, num_ops=3, seed=7).sample(50):
        assert p.question.startswith("What is ") and p.question.endswith("?")
        assert str(_evaluate(p.question.removeprefix("What is ").removesuffix("?"))) == p.answer


def test_word_problems_name_every_operand():
    problems = ArithmeticTask(word_problems=True, num_ops=3, seed=1).sample(60)
    for p in problems:
        assert p.meta["template"] != "bare"
        assert p.question.endswith("?")
        for n in p.meta["operands"]:
            assert str(n) in p.question
    assert len({p.meta["template"] for p in problems}) >= 8  # the themes vary
    assert {op for p in problems for op in p.meta["ops"]} == {"+", "-", "*", "/"}


def test_seeds_and_indices_differ():
    a, b = ArithmeticTask(seed=0).sample(20), ArithmeticTask(seed=1).sample(20)
    assert [p.question for p in a] != [p.question for p in b]
    assert len({p.question for p in a}) == 20
    assert ArithmeticTask(seed=0).sample(5, start=10) == a[10:15]


def test_knobs_raise_difficulty():
    def mean(xs):
        return sum(xs) / len(xs)

    easy = ArithmeticTask(digits=1, num_ops=1, seed=3).sample(40)
    hard = ArithmeticTask(digits=3, num_ops=4, seed=3).sample(40)
    assert mean([p.meta["difficulty"] for p in hard]) > mean([p.meta["difficulty"] for p in easy])
    assert mean([len(p.answer) for p in hard]) > mean([len(p.answer) for p in easy])
    assert all(len(p.meta["operands"]) == 5 for p in hard)
    only_add = ArithmeticTask(num_ops=3, ops=("+",), seed=3).sample(10)
    assert all(p.meta["ops"] == ["+", "+", "+"] for p in only_add)


def test_mixed_difficulty_draws_each_problem_its_own():
    fixed = ArithmeticTask(digits=2, num_ops=2, seed=5)
    assert ArithmeticTask(digits=2, num_ops=2, max_digits=2, max_ops=2, seed=5).sample(30) == fixed.sample(30)
    mixed = ArithmeticTask(digits=1, num_ops=1, max_digits=3, max_ops=4, seed=5).sample(200)
    assert {p.meta["digits"] for p in mixed} == {1, 2, 3}
    assert {p.meta["num_ops"] for p in mixed} == {1, 2, 3, 4}
    for p in mixed:
        d = p.meta["digits"]
        assert len(p.meta["ops"]) == p.meta["num_ops"]
        assert all((1 if d == 1 else 10 ** (d - 1)) <= n < 10**d for n in p.meta["operands"])
        assert p.answer == str(int(_evaluate(p.meta["expression"])))
    assert mixed == ArithmeticTask(digits=1, num_ops=1, max_digits=3, max_ops=4, seed=5).sample(200)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"digits": 0}, "digits"), ({"num_ops": 0}, "num_ops"), ({"ops": ("^",)}, "ops"), ({"ops": ()}, "ops"),
     ({"digits": 2, "max_digits": 1}, "max_digits"), ({"num_ops": 3, "max_ops": 2}, "max_ops")],
)  # fmt: skip
def test_bad_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


# ---- prompt formatting ----------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tiny_tokenizer(chat_template: str | None):
    """A byte-level BPE trained offline on a few strings, so every text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"]
    )
    tok.train_from_iterator(["What is 17 * 3? The answer is 51.", "Solve the problem step by step."], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = chat_template
    return fast


def test_format_prompt_with_chat_template():
    tok = _tiny_tokenizer(CHAT_TEMPLATE)
    p = Problem("What is 17 * 3?", "51")
    text = format_prompt_text(p, tok, system="Be brief.")
    assert text.startswith("<|system|>Be brief.<|end|>\n<|user|>What is 17 * 3?\n")
    assert '"The answer is N."' in text and text.endswith("<|assistant|>")
    ids = format_prompt(p, tok, system="Be brief.")
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert tok.decode(ids) == text
    assert not format_prompt_text(p, tok).startswith("<|system|>")


def test_format_prompt_without_chat_template():
    tok = _tiny_tokenizer(None)
    p = Problem("What is 2 + 2?", "4")
    text = format_prompt_text(p, tok, instruction=None)
    assert text == "Question: What is 2 + 2?\nAnswer:"
    assert tok.decode(format_prompt(p, tok, instruction=None)) == text
    assert format_prompt_text(p, tok, system="Sys").startswith("Sys\n\nQuestion: What is 2 + 2?\n")


# ---- dataset files --------------------------------------------------------------------------------------

GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips, then half as many. How many?", "answer": "48/2 = 24\n#### 72"},
    {"question": "A big sum?", "answer": "Add them.\n#### 1,234"},
    {"question": "Plain?", "answer": 5},
]  # fmt: skip


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_load_jsonl_gsm8k(tmp_path):
    problems = load_dataset_file(_write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS))
    assert [p.answer for p in problems] == ["72", "1234", "5"]
    assert problems[0].question.startswith("Natalia")
    assert problems[1].meta["raw_answer"] == "Add them.\n#### 1,234"
    assert reward("so 24 + 48 = 72.", problems[0].answer) == 1.0


def test_load_json_and_parquet(tmp_path):
    rows = [{"q": "One?", "a": "#### 1"}, {"q": "Two?", "a": 2.0}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    got = load_dataset_file(tmp_path / "d.json", question_field="q", answer_field="a")
    assert [(p.question, p.answer) for p in got] == [("One?", "1"), ("Two?", "2")]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS[:2]), tmp_path / "d.parquet")
    assert [p.answer for p in load_dataset_file(tmp_path / "d.parquet")] == ["72", "1234"]


def test_reference_answer():
    assert reference_answer("#### -3") == "-3"
    assert reference_answer("x, y") == "x, y"
    assert reference_answer(7) == "7"


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_dataset_file(tmp_path / "nope.jsonl")


def test_missing_field_names_field_line_and_keys(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}, {"question": "b", "sol": "2"}])
    with pytest.raises(DatasetError, match=r"line 2: missing field 'answer'; available keys: question, sol"):
        load_dataset_file(path)
    (tmp_path / "d.json").write_text(json.dumps([{"query": "x", "answer": "1"}]))
    with pytest.raises(DatasetError, match=r"record 0: missing field 'question'; available keys: answer, query"):
        load_dataset_file(tmp_path / "d.json")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.jsonl", "\n\n", "empty"),
        ("empty.json", "[]", "empty"),
        ("bad.jsonl", '{"question": "a", "answer": "1"}\n{"question": \n', "line 2 is not valid JSON"),
        ("bad.json", '[\n{"question": "a",\n]', "invalid JSON at line 3"),
        ("dict.json", '{"question": "a"}', "expected a JSON list"),
        ("scalar.jsonl", "3\n", "line 1: expected an object"),
        ("data.csv", "question,answer\n", "unsupported dataset format '.csv'"),
    ],
)
def test_dataset_errors(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(DatasetError, match=message) as info:
        load_dataset_file(tmp_path / name)
    assert name in str(info.value)


# ---- the prompt stream ----------------------------------------------------------------------------------


def _questions(batches):
    return [[p.question for p in b] for b in batches]


@pytest.mark.parametrize("use_task", [True, False])
def test_prompt_source_resumes_exactly(use_task):
    source = ArithmeticTask(seed=5) if use_task else ArithmeticTask(seed=5).sample(7)
    stream = PromptSource(source, batch_size=3, seed=11)
    for _ in range(4):  # 12 prompts: crosses an epoch boundary for the 7-problem list
        stream.next_batch()
    state = stream.state_dict()
    expected = [stream.next_batch() for _ in range(5)]
    resumed = PromptSource(source, batch_size=3, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON checkpoint
    assert _questions(resumed.next_batch() for _ in range(5)) == _questions(expected)


def test_prompt_source_epochs_cover_and_reshuffle():
    problems = ArithmeticTask(seed=2).sample(6)
    stream = PromptSource(problems, batch_size=6, seed=0)
    first, second = stream.next_batch(), stream.next_batch()
    assert sorted(p.question for p in first) == sorted(p.question for p in problems)
    assert sorted(p.question for p in second) == sorted(p.question for p in problems)
    assert [p.question for p in first] != [p.question for p in second]
    assert stream.state_dict()["epoch"] == 2
    assert _questions([PromptSource(problems, 6, seed=0).next_batch()]) == _questions([first])
    assert _questions([PromptSource(problems, 6, seed=1).next_batch()]) != _questions([first])
    plain = PromptSource(problems, batch_size=4, shuffle=False)
    assert plain.next_batch() == problems[:4]


def test_prompt_source_rejects_mismatched_state():
    stream = PromptSource(ArithmeticTask().sample(5), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="size"):
        stream.load_state_dict({"epoch": 0, "position": 1, "seed": 0, "size": 9})
    with pytest.raises(ValueError, match="seed"):
        stream.load_state_dict({"epoch": 0, "position": 1, "seed": 3, "size": 5})
    with pytest.raises(ValueError, match="batch_size"):
        PromptSource([], batch_size=0)
    with pytest.raises(ValueError, match="empty"):
        PromptSource([], batch_size=1)


def test_arithmetic_task_from_a_config_file_and_a_config_of_another_kind(tmp_path):
    from pathlib import Path

    from tlt_rt.config import TLTConfig, load_config
    from tlt_rt.train.rl.tasks import ArithmeticTask

    path = Path(__file__).resolve().parents[1] / "configs" / "qwen2.5-1.5b-math-gpu.yaml"
    got = ArithmeticTask.from_config_file(path)
    want = ArithmeticTask.from_config(load_config(TLTConfig, path).task)
    assert got.sample(5) == want.sample(5) and (got.digits, got.max_digits, got.max_ops) == (1, 3, 4)
    other = tmp_path / "jsonl.yaml"
    other.write_text("task:\n  kind: jsonl\n  path: data.jsonl\n")
    with pytest.raises(ValueError, match="task.kind is jsonl; only arithmetic prompts"):
        ArithmeticTask.from_config_file(other)
