"""What a caller asks of a generation and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How to sample. `temperature=0` is greedy; `stop_token_ids=None` means the model's EOS ids."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: list[int] | None = None
    seed: int = 0
    return_hidden: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtering(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    hidden: torch.Tensor | None = None
    """[prompt_len + len(token_ids) - 1, H] target last-layer hidden states of every position the target
    processed (prompt, then emitted tokens but the last), when `return_hidden` was asked."""
    stats: dict = field(default_factory=dict)
