"""A verifiable reward: pull the final answer out of a completion and compare it with the reference.

Extraction order: the last balanced `\\boxed{...}`, else the last "the answer is N" / "answer: N", else the
last number in the text. Numbers compare by value through a canonical string: commas, `$`, a leading "+"
and redundant zeros go ("051" == "51", "51.00" == "51", "-0" == "0"), while "51.5" stays itself. Work is
linear in the text length, so a runaway completion costs time proportional to its size and nothing more.
`extract_answer_text` reads the final answer as text instead, for verifiers that judge strings themselves.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections import deque
from collections.abc import Callable, Sequence

import torch

# A number as models write it: optional sign (ASCII or unicode minus), optional `$`, thousands groups only
# in threes ("1,234", not "1,2"), an optional decimal part. The look-behind keeps "x2" and "10-5" from
# yielding "2" and "-5".
_NUM = r"(?<![\w.])(?:[-+\u2212]\s?)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUM)
_LEADING_NUMBER_RE = re.compile(r"\s*(" + _NUM + r")")
# "The answer is: $1,234.00", "**Answer:** 42", "final answer = \(7\)": the gap after the marker may hold only
# markup, never words, so "the answer is that 3 apples ..." does not count.
# (The markup and its trailing gap form one optional group: two `\s*` runs in a row would split every run of
# spaces both ways before failing, quadratic in its length.)
_ANSWER_RE = re.compile(r"answer\s*(?:(?:\*\*|__)\s*)?(?:is|was|:|=)[\s*_$:=\\()\[\]{}]*(" + _NUM + ")", re.I)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|displaystyle)\s*\{([^{}]*)\}")
_SPACING_RE = re.compile(r"\\[!,;: ]|\\left|\\right|\\%|%|\$")
_CANONICAL_RE = re.compile(r"(-?)(\d+)(?:\.(\d+))?")
_GROUPED_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_BRACE_RE = re.compile(r"(?<!\\)[{}]")
_UNITS_RE = re.compile(r"[\sA-Za-z.]*")


def normalize_answer(text: str) -> str:
    """Canonical form of an answer string; numbers become e.g. "1234", "-5", "51.5"; other text is trimmed."""
    s = text.strip().replace("\u2212", "-").replace("$", "").replace("**", "").strip()
    s = s.rstrip(".").strip()
    if s.startswith("+"):
        s = s[1:].lstrip()
    if s.startswith("-"):
        s = "-" + s[1:].lstrip()
    # Commas go only as thousands separators: "1,234" is a number, "1,2" stays text.
    plain = s.replace(",", "") if _GROUPED_RE.fullmatch(s) else s
    m = _CANONICAL_RE.fullmatch(plain)
    if m is None:
        return " ".join(s.split())
    # String surgery rather than int()/Decimal: no digit limit and no exponent notation for huge values.
    sign, whole, frac = m.group(1), m.group(2).lstrip("0") or "0", (m.group(3) or "").rstrip("0")
    body = f"{whole}.{frac}" if frac else whole
    return "0" if body == "0" else sign + body


def _closing_braces(text: str) -> dict[int, int]:
    """Map each `{` index to its matching `}` index, in one pass (escaped braces are literal)."""
    closing, stack = {}, []
    for m in _BRACE_RE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closing[stack.pop()] = m.start()
    return closing


def _boxed_content(text: str) -> str | None:
    starts = [m.end() - 1 for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    closing = _closing_braces(text)
    for open_at in reversed(starts):
        close_at = closing.get(open_at)
        if close_at is not None and text[open_at + 1 : close_at].strip():
            return text[open_at + 1 : close_at]
    return None


def _unwrap(content: str) -> str:
    """`\\text{...}`, `\\mathrm{...}` and the like removed, nested ones too."""
    s = content
    for _ in range(len(s)):  # each round removes one wrapper, so this ends
        unwrapped = _WRAPPER_RE.sub(r"\1", s)
        if unwrapped == s:
            break
        s = unwrapped
    return s


def _clean_boxed(content: str) -> str | None:
    s = _SPACING_RE.sub("", _unwrap(content)).strip()
    # "x = 5" -> "5"; "42 apples" -> "42"; anything else ("\frac{1}{2}", "12/5") is kept as text.
    tail = s.rsplit("=", 1)[-1]
    m = _LEADING_NUMBER_RE.match(tail)
    if m is not None and _UNITS_RE.fullmatch(tail, m.end()):
        return normalize_answer(m.group(1))
    s = normalize_answer(s)
    return s or None


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = deque(pattern.finditer(text), maxlen=1)
    return found[0] if found else None


def extract_answer(text: str) -> str | None:
    """The final answer in a completion, normalised by `normalize_answer`, or None if there is none."""
    if not isinstance(text, str) or not text:
        return None
    boxed = _boxed_content(text)
    if boxed is not None:
        cleaned = _clean_boxed(boxed)
        if cleaned is not None:
            return cleaned
    phrase = _last_match(_ANSWER_RE, text)
    if phrase is not None:
        return normalize_answer(phrase.group(1))
    number = _last_match(_NUMBER_RE, text)
    return normalize_answer(number.group(0)) if number is not None else None


# "The answer is: **apple, pear**." -> "apple, pear": the rest of the line after the marker, for answers that are
# not numbers (a list, a word, an expression), which a dataset's own verifier then judges
_ANSWER_LINE_RE = re.compile(r"answer\s*(?:(?:\*\*|__)\s*)?(?:is|was|:|=)[ \t:=]*([^\n]*)", re.I)
_TAG_OPEN, _TAG_CLOSE = "<answer>", "</answer>"


def _strip_markup(s: str) -> str:
    """`s` without the markup around it: `**`/`__`/backticks, `$...$` / `\\(...\\)` / `\\[...\\]`, a final "."."""
    for _ in range(4):  # markup nests two or three deep ("**$5$**."); a fixed bound keeps runaway text linear
        before = s
        s = s.strip().rstrip(".").strip("*_` \t")
        for left, right in (("\\(", "\\)"), ("\\[", "\\]"), ("$", "$")):
            if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
                s = s[len(left) : len(s) - len(right)]
        if s == before:
            break
    return s


def extract_answer_text(text: str) -> str | None:
    """The final answer in a completion as text, for verifiers that judge strings themselves (reasoning-gym's):
    the content of the last `<answer>...</answer>` (reasoning-gym's own convention, taken as it is but for
    surrounding whitespace), else the last balanced `\\boxed{...}` with its `\\text{}`-style wrappers removed,
    else the rest of the line after the last "the answer is" / "answer:", else the last number. From the last
    three the markup around the answer goes (`**`, `$...$`, a final "."); nothing else is normalised. None when
    there is no answer. Linear in the text length, like `extract_answer`."""
    if not isinstance(text, str) or not text:
        return None
    close = text.rfind(_TAG_CLOSE)
    if close >= 0:
        start = text.rfind(_TAG_OPEN, 0, close)
        if start >= 0:
            tagged = text[start + len(_TAG_OPEN) : close].strip()  # as reasoning-gym reads its tags
            if tagged:
                return tagged
    boxed = _boxed_content(text)
    if boxed is not None and (unboxed := _strip_markup(_unwrap(boxed))):
        return unboxed
    phrase = _last_match(_ANSWER_LINE_RE, text)
    if phrase is not None and (said := _strip_markup(phrase.group(1))):
        return said
    number = _last_match(_NUMBER_RE, text)
    return normalize_answer(number.group(0)) if number is not None else None


def reward(text: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the reference (numbers by value), else 0.0.

    Never raises: a completion with no readable answer, or input of the wrong type, scores 0.0.
    """
    try:
        if answer is None:
            return 0.0
        reference = str(answer)
        if "####" in reference:  # a raw GSM8K solution passed as the reference
            reference = reference.rsplit("####", 1)[1]
        predicted = extract_answer(text)
        return 1.0 if predicted is not None and predicted == normalize_answer(reference) else 0.0
    except Exception:
        return 0.0


def batch_rewards(texts: Sequence[str], answers: Sequence[str]) -> torch.Tensor:
    """Rewards for paired completions and references: float32 tensor of shape [len(texts)]."""
    if len(texts) != len(answers):
        raise ValueError(f"batch_rewards got {len(texts)} texts but {len(answers)} answers")
    return torch.tensor([reward(t, a) for t, a in zip(texts, answers, strict=True)], dtype=torch.float32)


RewardFn = Callable[[str, str], float]


def math_verify_reward(text: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference (LaTeX, fractions, sets...)."""
    from math_verify import parse, verify  # local: optional extra (tlt_rt[math])

    try:
        gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
        return 1.0 if gold and verify(gold, parse(text)) else 0.0
    except Exception:  # a completion the parser cannot read scores 0, like `reward`
        return 0.0


def resolve_reward(spec: str) -> RewardFn:
    """The reward function that `task.reward` names: 'numeric', 'math_verify' or 'module:function'.
    Raises ValueError saying what is missing (the extra to install, the module or attribute not found)."""
    if spec == "numeric":
        return reward
    if spec == "math_verify":
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError("math_verify needs the math-verify package: pip install 'tlt_rt[math]'")
        return math_verify_reward
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"must be 'numeric', 'math_verify' or 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for reward {spec!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no function {attr!r} (reward {spec!r})")
    return fn
