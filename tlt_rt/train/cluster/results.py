"""What workers send back to the driver through Ray: small typed records instead of dicts and tuples."""

from __future__ import annotations

import dataclasses
from typing import Any

from tlt_rt.train.drafter.tail import DrafterTraining
from tlt_rt.train.rl.learner import LearnResult

__all__ = ["DrafterTraining", "LearnResult", "RolloutResult", "Sample", "StepRollout"]


@dataclasses.dataclass
class Sample:
    """One generated response: which prompt of the worker's share, which of its `n` samples."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclasses.dataclass
class RolloutResult:
    """One worker's share of a step's rollout."""

    rank: int
    samples: list[Sample]
    timeline: list[dict[str, Any]]  # the engine's per-step entries (kind, running, seconds, ...)
    stats: dict[str, Any]  # engine statistics over this rollout (generated tokens, accept lengths, ...)
    sd_policy: dict[str, Any] | None  # the SD policy's reading per batch bucket (sd_explain.explain_policy)
    start: float
    end: float
    num_seqs: int
    capacity: int  # the batch the engine ran before its tail
    tail: DrafterTraining | None = None  # drafter training during this worker's own tail


@dataclasses.dataclass
class StepRollout:
    """A whole step's rollout over the pool: every rank's share and its idle-time drafter training."""

    results: list[RolloutResult]
    trainings: dict[int, DrafterTraining]
    start: float
    end: float

    def drafter_steps(self) -> list[int]:
        """Drafter steps each rank trained this step (idle and tail), the weights of the replica merge."""
        return [self.trainings[r.rank].steps + (r.tail.steps if r.tail else 0) for r in self.results]
