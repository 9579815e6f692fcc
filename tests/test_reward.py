"""The verifiable reward: answer extraction on tricky completions, and a reward that never raises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tlt_rt.train.rl.reward import batch_rewards, extract_answer, normalize_answer, reward

EXTRACT_CASES = [
    # (completion, extracted answer)
    ("17*3 = 51.", "51"),  # SmolLM2's terse style: last number, trailing period dropped
    ("First 12 + 5 = 17, then 17 * 3 = 51", "51"),
    ("We have 3 apples and 4 pears, so 7 fruits.", "7"),
    ("The answer is 42.", "42"),
    ("the ANSWER IS 42", "42"),
    ("The answer is: $1,234.00", "1234"),
    ("Answer: 7", "7"),
    ("**Answer:** 42 apples, which took 3 steps", "42"),
    ("The answer is **42**.", "42"),
    ("The answer is 10. Checking: 2 * 5 = 10 and 3 + 7 = 10, also 11 is wrong", "10"),
    ("The answer is 5. Wait, no. The answer is 6.", "6"),
    ("So the final answer = \\(7\\)", "7"),
    ("The answer is -5.", "-5"),
    ("The answer is \u22125", "-5"),
    ("The answer is +8", "8"),
    ("Result: 51.0", "51"),
    ("Result: 51.00", "51"),
    ("Result: 51.5", "51.5"),
    ("Result: 051", "51"),
    ("It costs $1,234,567 in total", "1234567"),
    ("\\boxed{42}", "42"),
    ("First \\boxed{3}, then corrected: \\boxed{4}. The answer is 9", "4"),  # boxed wins, last one
    ("So \\boxed{1,234}.", "1234"),
    ("\\boxed{-5}", "-5"),
    ("\\boxed{\\text{42}}", "42"),
    ("\\boxed{\\textbf{\\text{42}}}", "42"),
    ("\\boxed{42 \\text{ apples}}", "42"),
    ("\\boxed{x = 12}", "12"),
    ("\\boxed {$17$}", "17"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces, kept as text
    ("The answer is \\boxed{42", "42"),  # unbalanced boxed: fall back to the phrase
    ("\\boxed{7} and then \\boxed{8", "7"),  # the last balanced box
    ("\\boxed{}  so 3", "3"),  # an empty box does not count
    ("x2 plus y3", None),  # digits glued to words are not numbers
    ("10-5 leaves 5", "5"),
    ("The total is 5.5.", "5.5"),
    ("values 1,2 and 3", "3"),
    ("no numbers here at all", None),
    ("", None),
    ("}}}{{{\\boxed{{{", None),
    ("The answer is that we need more. 2+2=4", "4"),  # words after the marker: not an answer phrase
    ("-0", "0"),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACT_CASES)
def test_extract_answer_table(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [("1,234", "1234"), ("$5", "5"), ("+3", "3"), ("\u22127", "-7"), ("007", "7"), ("2.50", "2.5"),
     ("0.0", "0"), ("-0.00", "0"), ("72.", "72"), (" 8 ", "8"), ("1,2", "1,2"), ("x  +  1", "x + 1")],
)  # fmt: skip
def test_normalize_answer(raw, canonical):
    assert normalize_answer(raw) == canonical


def test_reward_scores_exact_matches():
    assert reward("so 17*3 = 51.", "51") == 1.0
    assert reward("The answer is 051", "51") == 1.0  # numbers compare by value
    assert reward("\\boxed{1,234}", "1234") == 1.0
    assert reward("The answer is 52.", "51") == 0.0
    assert reward("The answer is 51.5", "51") == 0.0
    assert reward("no idea", "51") == 0.0
    assert reward("The answer is 72", "She sold 48/2 = 24 clips.\n#### 72") == 1.0  # raw GSM8K reference


@pytest.mark.parametrize(
    ("text", "answer"),
    [(None, "1"), (5, "5"), ("5", None), (b"5", "5"), ("\\boxed{" * 1000, "1"), ("}" * 1000, "1"),
     ("{" * 50_000 + "\\boxed{" * 50_000 + "9", "9")],
)  # fmt: skip
def test_reward_never_raises_on_odd_input(text, answer):
    assert reward(text, answer) in (0.0, 1.0)


def test_reward_on_a_long_completion():
    text = "step 1. " * 200_000 + "The answer is 12."
    assert reward(text, "12") == 1.0


def test_a_long_gap_after_answer_costs_linear_time():
    import time

    t0 = time.perf_counter()
    assert extract_answer("answer" + " " * 50_000 + "x 3") == "3"
    assert extract_answer("**Answer**" + " " * 50_000 + "is 4") == "4"
    assert time.perf_counter() - t0 < 1.0  # two `\s*` runs in a row made it quadratic: ~40 s


@given(st.text(), st.text())
def test_reward_never_raises(text, answer):
    assert reward(text, answer) in (0.0, 1.0)


@given(st.text(alphabet=st.sampled_from(list("0123456789{}\\boxed$,.-+ answerIS:*=")), max_size=200))
def test_reward_never_raises_on_answer_like_noise(text):
    assert reward(text, "5") in (0.0, 1.0)


@given(st.integers(min_value=-(10**30), max_value=10**30))
def test_integers_round_trip(n):
    assert reward(f"The answer is {n:,}.", str(n)) == 1.0
    assert reward(f"\\boxed{{{n}}}", str(n)) == 1.0
    assert extract_answer(f"work work {n}") == str(n)


def test_batch_rewards():
    out = batch_rewards(["The answer is 3", "\\boxed{4}", "nothing"], ["3", "5", "1"])
    assert out.dtype == torch.float32
    assert out.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 texts but 1 answers"):
        batch_rewards(["a", "b"], ["1"])
