"""The default RL task: arithmetic problems, dataset files, prompt formatting, a resumable prompt stream.

Every problem carries an answer that a verifier (`tlt_rt.train.rl.reward`) can check exactly, so GRPO gets a
clean 0/1 reward without a learned judge.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tlt_rt.config import DEFAULT_INSTRUCTION


@dataclass
class Problem:
    """One prompt with its verifiable reference answer (an integer's canonical string for arithmetic)."""

    question: str
    answer: str
    meta: dict = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None
    """The prompt as chat messages, when the dataset gave it so (verl, TRL conversational); `question` is
    then its last user message."""


# ---- the arithmetic generator ---------------------------------------------------------------------------

_NAMES = (
    "Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas",
    "Kira", "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq",
)  # fmt: skip

# Each theme tells one story: a start amount, then one sentence per operation, then the question.
# `start_mul` phrases a leading multiplication naturally ("a boxes with b each"); `unit` names the counted
# thing for the generic multiply/divide sentences.
_THEMES: tuple[dict[str, str], ...] = (
    dict(key="apples", unit="apples", start="{name} has {x} apples.",
         add="{name} buys {n} more apples at the market.", sub="{name} sells {n} apples to a neighbour.",
         start_mul="{name} buys {a} bags of apples with {b} apples in each bag.",
         question="How many apples does {name} have now?"),
    dict(key="train", unit="passengers", start="A train leaves the station carrying {x} passengers.",
         add="At the next stop, {n} passengers get on.", sub="At the following stop, {n} passengers get off.",
         start_mul="A train has {a} carriages with {b} passengers in each carriage.",
         question="How many passengers are on the train now?"),
    dict(key="savings", unit="dollars", start="{name} has ${x} in a savings account.",
         add="{name} deposits ${n}.", sub="{name} withdraws ${n} to pay a bill.",
         start_mul="{name} saves ${b} every week for {a} weeks.",
         question="How many dollars does {name} have now?"),
    dict(key="pens", unit="pens", start="A shop has {x} pens in stock.",
         add="A delivery brings {n} more pens.", sub="Customers buy {n} pens.",
         start_mul="A shop receives {a} boxes of pens with {b} pens in each box.",
         question="How many pens does the shop have now?"),
    dict(key="library", unit="books", start="A library has {x} books on its shelves.",
         add="It receives a donation of {n} books.", sub="Readers borrow {n} books.",
         start_mul="A library has {a} shelves with {b} books on each shelf.",
         question="How many books are on the shelves now?"),
    dict(key="cookies", unit="cookies", start="{name} bakes {x} cookies.",
         add="{name} bakes another {n} cookies.", sub="{name}'s friends eat {n} cookies.",
         start_mul="{name} bakes {a} trays of cookies with {b} cookies on each tray.",
         question="How many cookies are left?"),
    dict(key="marbles", unit="marbles", start="{name} has {x} marbles.",
         add="{name} wins {n} marbles in a game.", sub="{name} loses {n} marbles.",
         start_mul="{name} has {a} jars with {b} marbles in each jar.",
         question="How many marbles does {name} have now?"),
    dict(key="eggs", unit="eggs", start="A farm collects {x} eggs.",
         add="The hens lay {n} more eggs.", sub="{n} eggs are sold at the market.",
         start_mul="A farm has {a} hens and each hen lays {b} eggs.",
         question="How many eggs does the farm have now?"),
    dict(key="tickets", unit="tickets", start="A theatre sells {x} tickets on Monday.",
         add="It sells {n} more tickets on Tuesday.", sub="{n} tickets are refunded.",
         start_mul="A theatre has {a} rows with {b} seats in each row, and every seat is sold.",
         question="How many tickets are sold in the end?"),
    dict(key="warehouse", unit="crates", start="A warehouse stores {x} crates.",
         add="A truck delivers {n} crates.", sub="{n} crates are shipped out.",
         start_mul="{a} trucks each deliver {b} crates to an empty warehouse.",
         question="How many crates are in the warehouse now?"),
    dict(key="garden", unit="tulips", start="{name} plants {x} tulips.",
         add="{name} plants {n} more tulips.", sub="Rabbits eat {n} of the tulips.",
         start_mul="{name} plants {a} rows of tulips with {b} tulips in each row.",
         question="How many tulips are in the garden now?"),
    dict(key="tank", unit="litres", start="A tank holds {x} litres of water.",
         add="{n} litres are poured in.", sub="{n} litres are drained out.",
         start_mul="{a} buckets of {b} litres each are poured into an empty tank.",
         question="How many litres of water are in the tank now?"),
    dict(key="stickers", unit="stickers", start="{name} has {x} stickers.",
         add="{name} gets {n} stickers as a gift.", sub="{name} gives {n} stickers to a friend.",
         start_mul="{name} buys {a} sheets of stickers with {b} stickers on each sheet.",
         question="How many stickers does {name} have now?"),
)  # fmt: skip

_MUL = (
    "Then the number of {unit} becomes {n} times as large.",
    "After that, the {unit} are multiplied by {n}.",
)
_DIV = (
    "Then the {unit} are split equally into {n} groups, and only one group is kept.",
    "After that, the {unit} are shared equally among {n} people, and we follow one share.",
)
_PRECEDENCE = {"+": 0, "-": 0, "*": 1, "/": 1}


def _apply(value: int, op: str, n: int) -> int:
    if op == "+":
        return value + n
    if op == "-":
        return value - n
    if op == "*":
        return value * n
    return value // n  # callers only pick divisors that divide exactly


class ArithmeticTask:
    """Seeded arithmetic problems with exact, positive integer answers.

    `problem(i)` is a pure function of (seed, i) and the knobs, so a cursor of plain indices resumes
    exactly. Knobs: `digits` per operand, `num_ops` operations drawn from `ops` (division appears only
    where it divides), and `word_problems` (story templates) vs bare expressions ("What is 17 * 3?").
    Intermediate values stay >= 1 so no story ever counts negative apples.
    """

    def __init__(
        self,
        digits: int = 2,
        num_ops: int = 2,
        word_problems: bool = True,
        seed: int = 0,
        ops: Sequence[str] = ("+", "-", "*", "/"),
    ) -> None:
        if digits < 1:
            raise ValueError(f"ArithmeticTask.digits must be >= 1, got {digits}")
        if num_ops < 1:
            raise ValueError(f"ArithmeticTask.num_ops must be >= 1, got {num_ops}")
        bad = [op for op in ops if op not in _PRECEDENCE]
        if not ops or bad:
            raise ValueError(f"ArithmeticTask.ops must be a non-empty subset of '+-*/', got {list(ops)}")
        self.digits, self.num_ops, self.word_problems, self.seed = digits, num_ops, word_problems, seed
        self.ops = tuple(ops)
        self._lo, self._hi = (1 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1

    def sample(self, n: int, start: int = 0) -> list[Problem]:
        """Problems `start .. start+n-1`; stateless, so the same call gives the same list."""
        return [self.problem(start + i) for i in range(n)]

    def problem(self, index: int) -> Problem:
        # A string seed is hashed with SHA-512 by `random`, stable across processes and PYTHONHASHSEED.
        rng = random.Random(f"arith:{self.seed}:{index}")
        value = rng.randint(self._lo, self._hi)
        operands, steps = [value], []
        for _ in range(self.num_ops):
            op, n = self._pick_step(rng, value)
            steps.append(op)
            operands.append(n)
            value = _apply(value, op, n)
        expression = _render_expression(operands, steps)
        if self.word_problems:
            question, template = _render_story(rng, operands, steps)
        else:
            question, template = f"What is {expression}?", "bare"
        meta = {
            "task": "arithmetic",
            "seed": self.seed,
            "index": index,
            "digits": self.digits,
            "num_ops": self.num_ops,
            "operands": operands,
            "ops": steps,
            "expression": expression,
            "template": template,
            # A rough ordinal for curricula: operand size times chain length, plus the harder ops.
            "difficulty": self.digits * self.num_ops + sum(op in "*/" for op in steps),
        }
        return Problem(question=question, answer=str(value), meta=meta)

    def _pick_step(self, rng: random.Random, value: int) -> tuple[str, int]:
        order = list(self.ops)
        rng.shuffle(order)
        for op in order:
            if op == "+":
                return op, rng.randint(self._lo, self._hi)
            if op == "*":
                return op, rng.randint(max(self._lo, 2), self._hi)
            if op == "-" and value - 1 >= self._lo:
                return op, rng.randint(self._lo, min(self._hi, value - 1))
            if op == "/" and (divisor := self._pick_divisor(rng, value)) is not None:
                return op, divisor
        # Only '-' and '/' can be infeasible; '+' always keeps the chain going.
        return "+", rng.randint(self._lo, self._hi)

    def _pick_divisor(self, rng: random.Random, value: int) -> int | None:
        lo, hi = max(self._lo, 2), min(self._hi, value)
        if hi - lo < 20_000:
            divisors = [d for d in range(lo, hi + 1) if value % d == 0]
            return rng.choice(divisors) if divisors else None
        # Wide operands: a bounded random search keeps problem() cheap; division just shows up less.
        for _ in range(64):
            d = rng.randint(lo, hi)
            if value % d == 0:
                return d
        return None


def _render_expression(operands: list[int], steps: list[str]) -> str:
    # The chain is evaluated left to right; parenthesise only where precedence would reorder it.
    expr, top = str(operands[0]), None
    for op, n in zip(steps, operands[1:], strict=True):
        if top is not None and _PRECEDENCE[op] > top:
            expr = f"({expr})"
        expr, top = f"{expr} {op} {n}", _PRECEDENCE[op]
    return expr


def _render_story(rng: random.Random, operands: list[int], steps: list[str]) -> tuple[str, str]:
    theme, name = rng.choice(_THEMES), rng.choice(_NAMES)
    pairs = list(zip(steps, operands[1:], strict=True))
    if steps[0] == "*":
        sentences = [theme["start_mul"].format(name=name, a=operands[0], b=operands[1])]
        pairs = pairs[1:]
    else:
        sentences = [theme["start"].format(name=name, x=operands[0])]
    for op, n in pairs:
        template = {"+": theme["add"], "-": theme["sub"], "*": rng.choice(_MUL), "/": rng.choice(_DIV)}[op]
        sentences.append(template.format(name=name, n=n, unit=theme["unit"]))
    sentences.append(theme["question"].format(name=name))
    return " ".join(sentences), theme["key"]


# ---- prompt formatting ----------------------------------------------------------------------------------


def _messages(problem: Problem, system: str | None, instruction: str | None) -> list[dict[str, str]]:
    if problem.messages is not None:  # a dataset's own chat carries its own instructions
        return [dict(m) for m in problem.messages]
    content = f"{problem.question}\n{instruction}" if instruction else problem.question
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return messages


def _plain_prompt(problem: Problem, system: str | None, instruction: str | None) -> str:
    if problem.messages is not None:
        turns = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in problem.messages)
        return f"{turns}\n\nAssistant:"
    head = f"{system}\n\n" if system else ""
    ask = f"\n{instruction}" if instruction else ""
    return f"{head}Question: {problem.question}{ask}\nAnswer:"


def format_prompt_text(
    problem: Problem, tokenizer: Any, system: str | None = None, instruction: str | None = DEFAULT_INSTRUCTION
) -> str:
    """The prompt as text: the tokenizer's chat template with a generation prompt, else a plain Q/A form."""
    if getattr(tokenizer, "chat_template", None):
        messages = _messages(problem, system, instruction)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return _plain_prompt(problem, system, instruction)


def format_prompt(
    problem: Problem, tokenizer: Any, system: str | None = None, instruction: str | None = DEFAULT_INSTRUCTION
) -> list[int]:
    """The prompt as token ids, formatted as in `format_prompt_text`."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(_plain_prompt(problem, system, instruction)))
    messages = _messages(problem, system, instruction)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # older/newer transformers may return an encoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


# ---- dataset files --------------------------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


class DatasetError(ValueError):
    """A dataset file that cannot be turned into problems; the message names the file and the place."""


def reference_answer(raw: Any) -> str:
    """A dataset answer as a reference string: GSM8K's "...\\n#### 1,234" becomes "1234"."""
    if isinstance(raw, bool):
        return str(raw)
    if isinstance(raw, float) and raw.is_integer():
        return str(int(raw))
    text = str(raw)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    # Commas are thousands separators only when what remains is a number; "x, y" keeps its comma.
    plain = text.replace(",", "")
    return plain if _NUMBER.fullmatch(plain) else text


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DatasetError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}, line {line}); "
            "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from e


def _read_records(path: Path) -> list[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}: line {lineno} is not valid JSON: {e.msg}") from e
        return records
    if suffix == ".json":
        try:
            data = json.loads(_read_text(path))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
        if not isinstance(data, list):
            raise DatasetError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        return [(f"record {i}", rec) for i, rec in enumerate(data)]
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DatasetError(f"{path}: reading parquet needs pyarrow: pip install pyarrow (or tlt_rt[data])") from e
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family: name the file
            raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
        return [(f"row {i}", rec) for i, rec in enumerate(table.to_pylist())]
    raise DatasetError(f"{path}: unsupported dataset format {suffix!r}; use .jsonl, .json or .parquet")


# the defaults' fallbacks: verl's parquet (`prompt` messages, `reward_model.ground_truth`) and TRL's
# (`prompt`, with `solution` / `ground_truth` / `answer` columns)
QUESTION_FALLBACKS = ("prompt",)
ANSWER_FALLBACKS = ("reward_model.ground_truth", "solution", "ground_truth")


def _get(record: dict, name: str) -> Any:
    """`record[name]`, or for a dotted name the nested value (`reward_model.ground_truth`); None if absent."""
    if name in record:
        return record[name]
    value: Any = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _first(record: dict, names: Sequence[str]) -> tuple[str, Any]:
    for name in names:
        value = _get(record, name)
        if value is not None:
            return name, value
    return names[0], None


def _chat(value: Any) -> list[dict[str, str]] | None:
    """A chat message list ([{role, content}, ...]) as plain dicts, or None when `value` is not one."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):  # fmt: skip
        return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def load_dataset_file(
    path: str | Path, question_field: str = "question", answer_field: str = "answer"
) -> list[Problem]:
    """Problems from a .jsonl, .json (a list of objects) or .parquet file of question/answer records.

    The question may be text or a chat message list; with the default field names, verl's and TRL's
    layouts load as they are (see QUESTION_FALLBACKS / ANSWER_FALLBACKS)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    records = _read_records(path)
    if not records:
        raise DatasetError(f"{path}: the dataset is empty")
    q_names = [question_field, *(QUESTION_FALLBACKS if question_field == "question" else ())]
    a_names = [answer_field, *(ANSWER_FALLBACKS if answer_field == "answer" else ())]
    problems = []
    for index, (where, record) in enumerate(records):
        if not isinstance(record, dict):
            raise DatasetError(f"{path}, {where}: expected an object, got {type(record).__name__}")
        (q_name, question), (_, raw) = _first(record, q_names), _first(record, a_names)
        for names, value in ((q_names, question), (a_names, raw)):
            if value is None:
                keys = ", ".join(sorted(map(str, record))) or "none"
                also = f" (also tried {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
                raise DatasetError(f"{path}, {where}: missing field {names[0]!r}; available keys: {keys}{also}")
        messages = _chat(question)
        if messages is not None:
            users = [m["content"] for m in messages if m["role"] == "user"]
            question = users[-1] if users else messages[-1]["content"]
        elif not isinstance(question, str):
            raise DatasetError(f"{path}, {where}: field {q_name!r} must be text or a list of chat messages "
                               f"({{'role': ..., 'content': ...}}), got {type(question).__name__}")  # fmt: skip
        meta = {"source": str(path), "index": index, "raw_answer": raw}
        problems.append(Problem(question=question, answer=reference_answer(raw), meta=meta, messages=messages))
    return problems


# ---- a resumable stream of prompt batches --------------------------------------------------------------


class PromptSource:
    """Deterministic batches of problems with a resumable cursor.

    Over an `ArithmeticTask` the cursor is the next problem index (the task's own seed fixes the
    problems). Over a list it walks epochs, each a fresh permutation drawn from (seed, epoch); batches run
    across epoch boundaries so every batch is full.
    """

    def __init__(
        self, source: ArithmeticTask | Sequence[Problem], batch_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"PromptSource.batch_size must be >= 1, got {batch_size}")
        if not isinstance(source, ArithmeticTask) and len(source) == 0:
            raise ValueError("PromptSource.source is empty")
        self.source, self.batch_size, self.seed, self.shuffle = source, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None

    @property
    def _size(self) -> int | None:
        return None if isinstance(self.source, ArithmeticTask) else len(self.source)

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            order = list(range(self._size or 0))
            if self.shuffle:
                random.Random(f"prompts:{self.seed}:{self.epoch}").shuffle(order)
            self._order = (self.epoch, order)
        return self._order[1]

    def next_batch(self) -> list[Problem]:
        if isinstance(self.source, ArithmeticTask):
            batch = self.source.sample(self.batch_size, start=self.position)
            self.position += self.batch_size
            return batch
        batch = []
        while len(batch) < self.batch_size:
            batch.append(self.source[self._epoch_order()[self.position]])
            self.position += 1
            if self.position == self._size:
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[list[Problem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self._size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Resuming over a different dataset or seed would silently replay other prompts: refuse it.
        for key, mine in (("seed", self.seed), ("size", self._size)):
            if state.get(key) != mine:
                raise ValueError(f"PromptSource state has {key}={state.get(key)!r}, this source has {mine!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
