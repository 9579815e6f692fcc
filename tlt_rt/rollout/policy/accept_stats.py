"""What the SD policy knows of accept lengths: tokens emitted per sequence per speculative step, learned
online per (batch bucket, strategy) and pooled per strategy (rollout/policy/sd_policy.py decides from it)."""

from __future__ import annotations

import math
from collections import Counter

from tlt_rt.ir.strategy import Strategy


class AcceptStats:
    """Online tokens emitted per sequence per speculative step (accepted drafts + 1 bonus), per (bucket, strategy).

    Accept length depends mostly on the strategy and the data, little on the batch, so each (bucket,
    strategy) estimate is shrunk toward the strategy's pooled estimate, which in turn is shrunk toward a
    prior; each pull weighs `prior_weight` readings and fades as readings come in. The prior is
    1 + prior_slope * depth until any strategy has readings; after that its excess over 1 is scaled by what
    the measured strategies showed against theirs (the same drafter serves every strategy: one that accepts
    nothing with 8_4_8 will not accept much with 8_4_48 either, so untried strategies stop looking good).
    Each estimate is a running mean until 1/alpha readings, then an EMA, so later drift (a retrained
    drafter, a changing policy) is followed.
    """

    def __init__(self, alpha: float = 0.1, prior_weight: float = 2.0, prior_slope: float = 0.4):
        self.alpha, self.prior_weight, self.prior_slope = alpha, prior_weight, prior_slope
        self._pooled: dict[str, list[float]] = {}  # name -> [mean, readings]
        self._cells: dict[str, list[float]] = {}  # "bucket/name" -> [mean, readings]
        self.hist: dict[str, Counter] = {}  # name -> Counter(rounded tokens per sequence)
        self._excess: dict[str, float] = {}  # name -> base prior - 1 of every strategy seen
        self._scale = 1.0  # measured excess accept over the base prior's, pooled over strategies
        self._means: dict[tuple[int, str], float] = {}  # `mean` as last computed, until the next reading

    def base_prior(self, strategy: Strategy) -> float:
        return min(1 + self.prior_slope * strategy.depth, strategy.depth + 1)

    def prior(self, strategy: Strategy) -> float:
        return min(1 + self._scale * (self.base_prior(strategy) - 1), strategy.depth + 1)

    def _rescale(self) -> None:
        num = den = 0.0
        for name, (m, n) in self._pooled.items():
            w = min(n, 10.0)  # a few readings of each strategy settle it; no one strategy dominates
            num, den = num + w * (m - 1) / self._excess[name], den + w
        self._scale = min(max(num / den, 0.0), 2.0) if den else 1.0

    def _blend(self, base: float, cell: list[float] | None) -> float:
        if cell is None:
            return base
        return (self.prior_weight * base + cell[1] * cell[0]) / (self.prior_weight + cell[1])

    def mean(self, bucket: int, strategy: Strategy | None) -> float:
        if strategy is None:
            return 1.0
        name = str(strategy)
        got = self._means.get((bucket, name))
        if got is None:  # the policy asks every step; the answer changes only with a reading
            pooled = self._blend(self.prior(strategy), self._pooled.get(name))
            got = self._means[(bucket, name)] = self._blend(pooled, self._cells.get(f"{bucket}/{name}"))
        return got

    def pooled_mean(self, strategy: Strategy) -> float:
        return self._blend(self.prior(strategy), self._pooled.get(str(strategy)))

    def measured(self, bucket: int, strategy: Strategy, min_readings: int = 3) -> float | None:
        """The accept length seen online, without the prior: the cell's, else the strategy's pooled one,
        else None while neither has `min_readings` readings."""
        for cell in (self._cells.get(f"{bucket}/{strategy}"), self._pooled.get(str(strategy))):
            if cell is not None and cell[1] >= min_readings:
                return cell[0]
        return None

    def observe(self, bucket: int, strategy: Strategy, tokens_per_seq: float) -> None:
        x = float(tokens_per_seq)
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"tokens_per_seq must be a finite number >= 0, got {tokens_per_seq}")
        x = min(max(x, 1.0), strategy.depth + 1.0)  # a step emits between 1 and depth + 1 tokens each
        name = str(strategy)
        for table, k in ((self._pooled, name), (self._cells, f"{bucket}/{name}")):
            est = table.setdefault(k, [0.0, 0])
            est[1] += 1
            est[0] += max(1 / est[1], self.alpha) * (x - est[0])
        self.hist.setdefault(name, Counter())[round(x)] += 1
        self._excess[name] = self.base_prior(strategy) - 1
        self._rescale()
        self._means.clear()

    def histogram(self) -> dict[str, dict[int, int]]:
        return {name: dict(sorted(h.items())) for name, h in sorted(self.hist.items())}

    def state_dict(self) -> dict:
        hist = {name: {str(k): v for k, v in h.items()} for name, h in self.histogram().items()}
        return {"pooled": self._pooled, "cells": self._cells, "hist": hist}

    def load_state_dict(self, state: dict) -> None:
        self._pooled = {k: list(v) for k, v in state["pooled"].items()}
        self._cells = {k: list(v) for k, v in state["cells"].items()}
        self.hist = {name: Counter({int(k): v for k, v in h.items()}) for name, h in state["hist"].items()}
        self._excess = {name: self.base_prior(Strategy.parse(name)) - 1 for name in self._pooled}
        self._rescale()
        self._means.clear()
