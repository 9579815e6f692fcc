"""What a caller asks of a generation and what it gets back, and the checks on both before any work."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

SEED_LIMIT = 1 << 64  # sequence seeds hash the low 64 bits: a larger (or negative) seed would alias another


def _is_int(v: Any) -> bool:
    """An integer value of any integer type (Python, numpy, 0-d torch), but not a bool."""
    if isinstance(v, torch.Tensor):
        return v.ndim == 0 and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _describe(v: Any) -> str:
    return f"{type(v).__name__} {v!r}" if len(repr(v)) <= 40 else type(v).__name__


@dataclass
class SamplingParams:
    """How to sample. `temperature=0` is greedy; `stop_token_ids=None` means the model's EOS ids.

    As in vLLM, `top_k` 0 or -1 means no top-k filter and `max_tokens` is accepted for `max_new_tokens`;
    a single stop id may be given as an int.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: list[int] | None = None
    seed: int = 0
    return_hidden: bool = False
    max_tokens: InitVar[int | None] = None

    def __post_init__(self, max_tokens: int | None) -> None:
        if max_tokens is not None:
            if self.max_new_tokens not in (256, max_tokens):
                raise ValueError(f"max_tokens ({max_tokens}) and max_new_tokens ({self.max_new_tokens}) disagree")
            self.max_new_tokens = max_tokens
        for name in ("n", "top_k", "max_new_tokens", "seed"):
            v = getattr(self, name)
            if not _is_int(v):
                raise ValueError(f"{name} must be an int, got {_describe(v)}")
            setattr(self, name, int(v))
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {_describe(v)}")
            setattr(self, name, float(v))
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1  # vLLM's spelling of "off"
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.return_hidden, bool):
            raise ValueError(f"return_hidden must be a bool, got {_describe(self.return_hidden)}")
        if self.stop_token_ids is not None:
            ids = [self.stop_token_ids] if _is_int(self.stop_token_ids) else self.stop_token_ids
            if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | set | frozenset | torch.Tensor):
                raise ValueError(f"stop_token_ids must be a list of ints, got {_describe(self.stop_token_ids)}")
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            bad = [t for t in ids if not _is_int(t)]
            if bad:
                raise ValueError(f"stop_token_ids must hold ints, got {_describe(bad[0])}")
            self.stop_token_ids = [int(t) for t in ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtering(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)


def _prompt_ids(i: int, p: Any, vocab_size: int) -> list[int]:
    if isinstance(p, str | bytes):
        raise ValueError(f"prompt {i} is text; generate() takes token ids: encode it with the tokenizer first")
    if isinstance(p, torch.Tensor):
        if p.ndim != 1:
            raise ValueError(f"prompt {i} is a tensor of shape {tuple(p.shape)}; a prompt is one 1-D row of ids")
        p = p.tolist()
    if not isinstance(p, Sequence) and not hasattr(p, "tolist"):
        raise ValueError(f"prompt {i} must be a list of token ids, got {_describe(p)}")
    ids = p.tolist() if hasattr(p, "tolist") and not isinstance(p, list) else list(p)
    if not ids:
        raise ValueError(f"prompt {i} is empty")
    # the usual prompt, plain Python ints in range, checked without a Python loop (128 prompts of ~100 ids
    # cost 11 ms per generate call one id at a time); anything else gets the checks below and their errors
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab_size:
        return ids
    for pos, t in enumerate(ids):
        if not _is_int(t):
            raise ValueError(f"prompt {i}, position {pos}: token ids must be ints, got {_describe(t)}")
    out = [int(t) for t in ids]
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return out


def check_prompts(
    prompts: Any, params: SamplingParams | None, vocab_size: int
) -> tuple[list[list[int]], SamplingParams]:
    """`generate()`'s input as plain token-id lists and SamplingParams, or a ValueError saying what is wrong."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompts, str | bytes):
        raise ValueError("prompts is text; generate() takes a list of token-id lists: encode with the tokenizer")
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2:
            raise ValueError(f"prompts is a tensor of shape {tuple(prompts.shape)}; expected [num_prompts, length]")
        prompts = list(prompts)
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("generate() got no prompts: pass a list of token-id lists")
    if all(_is_int(t) for t in prompts):
        raise ValueError(
            f"prompts is a flat list of {len(prompts)} ints; pass a list of prompts, e.g. [[1, 5, 7]] for one prompt"
        )
    ids = [_prompt_ids(i, p, vocab_size) for i, p in enumerate(prompts)]
    bad = [t for t in params.stop_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size}): they can never stop")
    return ids, params


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
