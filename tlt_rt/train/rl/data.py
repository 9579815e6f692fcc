"""The RL task's data: prompt formatting and a resumable prompt stream, over the generated problems
(`tasks.py`, `reasoning_gym_task.py`) or a dataset file (`dataset_files.py`), whose names this module
re-exports.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from tlt_rt.train.rl.config import DEFAULT_INSTRUCTION
from tlt_rt.train.rl.dataset_files import (
    ANSWER_FALLBACKS,
    QUESTION_FALLBACKS,
    DatasetError,
    load_dataset_file,
    reference_answer,
)
from tlt_rt.train.rl.reasoning_gym_task import ReasoningGymTask
from tlt_rt.train.rl.tasks import ArithmeticTask, Problem, ProblemGenerator

__all__ = [
    "ANSWER_FALLBACKS",
    "QUESTION_FALLBACKS",
    "ArithmeticTask",
    "DatasetError",
    "Problem",
    "ProblemGenerator",
    "PromptSource",
    "ReasoningGymTask",
    "format_prompt",
    "format_prompt_text",
    "load_dataset_file",
    "reference_answer",
]

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


# ---- a resumable stream of prompt batches --------------------------------------------------------------


class PromptSource:
    """Deterministic batches of problems with a resumable cursor.

    Over a generated task (`ArithmeticTask`, `ReasoningGymTask`) the cursor is the next problem index (the
    task's own seed fixes the problems). Over a list it walks epochs, each a fresh permutation drawn from
    (seed, epoch); batches run across epoch boundaries so every batch is full.
    """

    def __init__(
        self, source: ProblemGenerator | Sequence[Problem], batch_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"PromptSource.batch_size must be >= 1, got {batch_size}")
        self._generated = not isinstance(source, Sequence)
        if not self._generated and len(source) == 0:
            raise ValueError("PromptSource.source is empty")
        self.source, self.batch_size, self.seed, self.shuffle = source, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: tuple[int, list[int]] | None = None

    @property
    def _size(self) -> int | None:
        return None if self._generated else len(self.source)

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            order = list(range(self._size or 0))
            if self.shuffle:
                random.Random(f"prompts:{self.seed}:{self.epoch}").shuffle(order)
            self._order = (self.epoch, order)
        return self._order[1]

    def next_batch(self) -> list[Problem]:
        if self._generated:
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
