"""Problems from reasoning-gym (`task.kind: reasoning_gym`): one of its procedural datasets, scored by that
dataset's own verifier. The package is an optional extra (pip install 'tlt_rt[reasoning]'), imported only
when such a task is built.

reasoning-gym makes entry i of a dataset with seed s from `Random(s + i)`, so two seeds share entries a
fixed distance apart. The training stream therefore cycles through the first `size` indices
(`task.rg_size`), and held-out problems take the seed `size` above it: the two never meet.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from tlt_rt.train.rl.reward import extract_answer, extract_answer_text, normalize_answer
from tlt_rt.train.rl.tasks import Problem

INSTALL_HINT = "reasoning_gym needs the reasoning-gym package: pip install 'tlt_rt[reasoning]'"
# set from task.seed and task.rg_size; a dataset option of the same name would undo the held-out split
RESERVED_OPTIONS = ("seed", "size")


class UnknownDatasetError(ValueError):
    """A dataset name that reasoning-gym does not register; the message names the closest ones."""


def _factory() -> Any:
    try:
        from reasoning_gym import factory  # local: an optional extra, imported only by this task kind
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return factory


def dataset_names() -> list[str]:
    """The datasets reasoning-gym registers (ImportError with the install line when it is missing)."""
    return sorted(_factory().DATASETS)


class ReasoningGymTask:
    """Problem i is entry i of the reasoning-gym dataset `name` built with `options`, `seed` and `size`;
    indices at or past `size` wrap round. Like `ArithmeticTask`'s, `problem(i)` is a pure function of the
    arguments and i.

    Raises ImportError (with the install line) when reasoning-gym is missing, UnknownDatasetError on a name it
    does not register and ValueError on options the dataset's config refuses.
    """

    def __init__(self, name: str, options: dict[str, Any] | None = None, seed: int = 0, size: int = 100_000) -> None:
        factory = _factory()
        options = dict(options or {})
        if name not in factory.DATASETS:
            close = difflib.get_close_matches(name, list(factory.DATASETS), n=3)
            hint = f"did you mean {', '.join(map(repr, close))}?" if close else "see reasoning_gym.factory.DATASETS"
            raise UnknownDatasetError(f"unknown reasoning-gym dataset {name!r}; {hint}")
        reserved = [k for k in RESERVED_OPTIONS if k in options]
        if reserved:
            raise ValueError(f"options {reserved} are set by task.seed and task.rg_size, not by the dataset's options")
        if size < 1:
            raise ValueError(f"ReasoningGymTask.size must be >= 1, got {size}")
        config_cls = factory.DATASETS[name][1]
        known = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_OPTIONS]
        unknown = [k for k in options if k not in known]
        if unknown:
            raise ValueError(f"{name} has no option {unknown[0]!r}; its options: {', '.join(known)}")
        try:
            self.dataset = factory.create_dataset(name, seed=seed, size=size, **options)
        except (AssertionError, TypeError, ValueError) as e:  # the dataset config's own validate()
            raise ValueError(f"{name} refused options {options} with size {size}: {e or type(e).__name__}") from e
        self.name, self.options, self.seed, self.size = name, options, seed, size

    @classmethod
    def from_config(cls, task, held_out: bool = False) -> ReasoningGymTask:
        """The dataset a `task.` config section describes (kind reasoning_gym); `held_out` moves its seed past
        every training index, so held-out problems are never trained on."""
        seed = task.seed + (task.rg_size if held_out else 0)
        return cls(task.rg_dataset, task.rg_config, seed, task.rg_size)

    def sample(self, n: int, start: int = 0) -> list[Problem]:
        """Problems `start .. start+n-1`; stateless, so the same call gives the same list."""
        return [self.problem(start + i) for i in range(n)]

    def problem(self, index: int) -> Problem:
        entry = self.dataset[index % self.size]
        answer = entry.get("answer")
        meta = {"task": "reasoning_gym", "dataset": self.name, "seed": self.seed, "index": index, "entry": entry}
        return Problem(question=entry["question"], answer="" if answer is None else str(answer), meta=meta)

    def score(self, text: str, problem: Problem) -> float:
        """The dataset's verifier on the completion's final answer, read as text (`extract_answer_text`), in
        `normalize_answer`'s canonical form and as a number (`extract_answer`), whichever scores highest; 0.0
        when there is no answer."""
        found = extract_answer_text(text)
        readings = (found, normalize_answer(found) if found else None, extract_answer(text))
        best = 0.0
        for candidate in dict.fromkeys(r for r in readings if r):
            try:
                value = float(self.dataset.score_answer(answer=candidate, entry=problem.meta["entry"]))
            except Exception:  # a verifier that cannot parse the model's text: no credit, never a failed step
                continue
            best = max(best, value)
        return best
