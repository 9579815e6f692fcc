"""A reduced draft vocabulary from rollout statistics (FR-Spec: the most frequent target tokens).

The drafter's head then covers only `size` target ids (`Drafter.set_draft_vocab(d2t)`); verification stays
on the full vocabulary, so output stays exact, and a token outside the draft vocabulary is simply never
drafted. Counts come from the tokens the rollouts produced (prompt and answer), so the vocabulary follows
the policy as it moves: `DraftVocab.update(ids)` adds one RL step's tokens after multiplying the old
counts by `decay` (1.0 = all history counts alike; the drafter trainer rebuilds from its buffer's window of
recent steps instead). `build()` always keeps the `keep` ids (EOS and the like, so an answer's end can be
drafted) and fills the rest by count, ties to the smaller id.

A rebuilt vocabulary changes the drafter's head rows (and its size only when `size` changes); callers swap it
between rollouts, never while an engine runs a step with the old one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class DraftVocab:
    def __init__(self, vocab_size: int, size: int, keep: Iterable[int] = (), decay: float = 1.0):
        if not 0 < size <= vocab_size:
            raise ValueError(f"draft_vocab size must be in [1, {vocab_size}], got {size}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.keep = sorted({int(i) for i in keep})
        if len(self.keep) > size or any(not 0 <= i < vocab_size for i in self.keep):
            raise ValueError(f"keep ids {self.keep} must be < {vocab_size} and at most size={size} of them")
        self.vocab_size, self.size, self.decay = vocab_size, size, decay
        self.counts = torch.zeros(vocab_size, dtype=torch.float64)

    def update(self, ids: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Add one RL step's tokens (one id tensor or several), after decaying the older counts."""
        parts = [ids] if isinstance(ids, torch.Tensor) else list(ids)
        self.counts *= self.decay
        for t in parts:
            self.counts += torch.bincount(t.flatten().cpu().long(), minlength=self.vocab_size).double()

    def build(self, counts: torch.Tensor | None = None) -> torch.Tensor:
        """[size] int64 target ids: the `keep` ids, then the most frequent others (`counts` [V], default own)."""
        c = (self.counts if counts is None else counts.detach().cpu()).double().clone()
        if c.shape != (self.vocab_size,):
            raise ValueError(f"counts must have shape [{self.vocab_size}], got {tuple(c.shape)}")
        keep = torch.tensor(self.keep, dtype=torch.int64)
        c[keep] = float("inf")
        return torch.sort(c, descending=True, stable=True).indices[: self.size].to(torch.int64)

    def coverage(self, d2t: torch.Tensor, counts: torch.Tensor | None = None) -> float:
        """Share of the counted tokens that `d2t` covers (the ceiling on how often a drafted token can hit)."""
        c = (self.counts if counts is None else counts.detach().cpu()).double()
        total = float(c.sum())
        return float(c[d2t.cpu()].sum()) / total if total > 0 else float("nan")

    def state_dict(self) -> dict:
        return {"counts": self.counts.clone(), "size": self.size, "keep": list(self.keep), "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        if state["counts"].shape != (self.vocab_size,):
            raise ValueError(f"counts over {state['counts'].numel()} ids, this vocabulary has {self.vocab_size}")
        self.counts = state["counts"].double().clone()
        self.size, self.keep, self.decay = int(state["size"]), list(state["keep"]), float(state["decay"])
