"""A prompt with its verifiable answer (`Problem`), and the default RL task that makes them: seeded
arithmetic problems, as stories or bare expressions.

Every problem carries an answer that a verifier (`tlt_rt.train.rl.reward`) can check exactly, so GRPO gets a
clean 0/1 reward without a learned judge.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Problem:
    """One prompt with its verifiable reference answer (an integer's canonical string for arithmetic)."""

    question: str
    answer: str
    meta: dict = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None
    """The prompt as chat messages, when the dataset gave it so (verl, TRL conversational); `question` is
    then its last user message."""


class ProblemGenerator(Protocol):
    """A task that makes its problems on demand (`ArithmeticTask`, `ReasoningGymTask`): `sample(n, start)` is
    problems start .. start+n-1, a pure function of the task and the indices, so a cursor of indices resumes."""

    def sample(self, n: int, start: int = 0) -> list[Problem]: ...


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
    `max_digits` / `max_ops` above `digits` / `num_ops` mix difficulties: each problem draws its own
    from the inclusive range (a policy that starts at 20-50% accuracy has easy problems to learn from and
    hard ones left to learn). Intermediate values stay >= 1 so no story ever counts negative apples.
    """

    def __init__(
        self,
        digits: int = 2,
        num_ops: int = 2,
        word_problems: bool = True,
        seed: int = 0,
        ops: Sequence[str] = ("+", "-", "*", "/"),
        max_digits: int | None = None,
        max_ops: int | None = None,
    ) -> None:
        if digits < 1:
            raise ValueError(f"ArithmeticTask.digits must be >= 1, got {digits}")
        if num_ops < 1:
            raise ValueError(f"ArithmeticTask.num_ops must be >= 1, got {num_ops}")
        bad = [op for op in ops if op not in _PRECEDENCE]
        if not ops or bad:
            raise ValueError(f"ArithmeticTask.ops must be a non-empty subset of '+-*/', got {list(ops)}")
        self.max_digits, self.max_ops = max_digits or digits, max_ops or num_ops
        if self.max_digits < digits:
            raise ValueError(f"ArithmeticTask.max_digits ({self.max_digits}) must be >= digits ({digits})")
        if self.max_ops < num_ops:
            raise ValueError(f"ArithmeticTask.max_ops ({self.max_ops}) must be >= num_ops ({num_ops})")
        self.digits, self.num_ops, self.word_problems, self.seed = digits, num_ops, word_problems, seed
        self.ops = tuple(ops)

    @classmethod
    def from_config(cls, task, seed_offset: int = 0) -> ArithmeticTask:
        """The generator a `task.` config section describes (kind arithmetic), its seed moved by `seed_offset`
        (held-out problems, warm-up prompts apart from the RL's)."""
        return cls(task.digits, task.num_ops, task.word_problems, task.seed + seed_offset, ops=task.ops,
                   max_digits=task.max_digits, max_ops=task.max_ops)  # fmt: skip

    @classmethod
    def from_config_file(cls, path) -> ArithmeticTask:
        """The generator of an RL config file's `task.` section; ValueError unless its kind is arithmetic
        (the benchmarks and the drafter warm-up make prompts of a config's workload this way)."""
        # local: the RL config pulls in every section's module; only a config file's task needs it
        from tlt_rt.config_loader import load_config
        from tlt_rt.train.config import TLTConfig

        task = load_config(TLTConfig, path).task
        if task.kind != "arithmetic":
            raise ValueError(f"{path}: task.kind is {task.kind}; only arithmetic prompts are made from a config")
        return cls.from_config(task)

    def sample(self, n: int, start: int = 0) -> list[Problem]:
        """Problems `start .. start+n-1`; stateless, so the same call gives the same list."""
        return [self.problem(start + i) for i in range(n)]

    def problem(self, index: int) -> Problem:
        # A string seed is hashed with SHA-512 by `random`, stable across processes and PYTHONHASHSEED.
        rng = random.Random(f"arith:{self.seed}:{index}")
        # a fixed difficulty draws nothing here, so its problems are those of the knobs without ranges
        digits = rng.randint(self.digits, self.max_digits) if self.max_digits > self.digits else self.digits
        num_ops = rng.randint(self.num_ops, self.max_ops) if self.max_ops > self.num_ops else self.num_ops
        bounds = (1 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
        value = rng.randint(*bounds)
        operands, steps = [value], []
        for _ in range(num_ops):
            op, n = self._pick_step(rng, value, *bounds)
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
            "digits": digits,
            "num_ops": num_ops,
            "operands": operands,
            "ops": steps,
            "expression": expression,
            "template": template,
            # A rough ordinal for curricula: operand size times chain length, plus the harder ops.
            "difficulty": digits * num_ops + sum(op in "*/" for op in steps),
        }
        return Problem(question=question, answer=str(value), meta=meta)

    def _pick_step(self, rng: random.Random, value: int, lo: int, hi: int) -> tuple[str, int]:
        order = list(self.ops)
        rng.shuffle(order)
        for op in order:
            if op == "+":
                return op, rng.randint(lo, hi)
            if op == "*":
                return op, rng.randint(max(lo, 2), hi)
            if op == "-" and value - 1 >= lo:
                return op, rng.randint(lo, min(hi, value - 1))
            if op == "/" and (divisor := _pick_divisor(rng, value, lo, hi)) is not None:
                return op, divisor
        # Only '-' and '/' can be infeasible; '+' always keeps the chain going.
        return "+", rng.randint(lo, hi)


def _pick_divisor(rng: random.Random, value: int, lo: int, hi: int) -> int | None:
    lo, hi = max(lo, 2), min(hi, value)
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
