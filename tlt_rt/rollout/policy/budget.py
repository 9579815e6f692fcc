"""The speculation budget of the SD policy in "auto" mode (rollout/policy/sd_policy.py explains it in context).

Per batch bucket, speculative steps' regret (their time minus what plain decoding would have taken for the
tokens they emitted) is summed, fading over the policy's horizon; while it is above the bucket's budget share
of the bucket's decode time, only strategies proven by measured accept lengths and costs run there, and
exploring a dearer option goes ahead with a probability that keeps its expected extra time within the same
share. The share is `explore_budget`, halved per try in a row that left a strategy losing to a plain incumbent
(BACKOFF_HALVINGS at most).
"""

from __future__ import annotations

from collections.abc import Callable

from tlt_rt.ir.strategy import Strategy
from tlt_rt.rollout.policy.catchup import spread

BACKOFF_HALVINGS = 2  # a bucket's speculation budget halves per losing try in a row, down to 1/4 of it


class SpeculationBudget:
    """`SDPolicy`'s budget rules, over the attributes its constructor sets (costs, accept, catchup, _regret,
    _lost, explore_budget, epsilon, hysteresis, mode)."""

    def over_budget(self, bucket: int, extra: float = 0.0, step: float = 0.0) -> bool:
        """True while speculation has cost more than its budget of this bucket's decode time (auto only);
        with `extra` / `step`, whether a step expected to add that regret and take that long would be."""
        if self.mode != "auto" or self.explore_budget is None:
            return False
        regret, elapsed = self._regret.get(bucket, (0.0, 0.0))
        return regret + extra > self.budget(bucket) * (elapsed + step)

    def budget(self, bucket: int) -> float | None:
        """The share of this bucket's decode time speculation may cost: `explore_budget`, halved per losing try
        in a row there (module docstring); None without a budget."""
        if self.explore_budget is None:
            return None
        return self.explore_budget / 2 ** min(self._lost[bucket], BACKOFF_HALVINGS)

    def _expected_regret(self, bucket: int, choice: Strategy, behind: Callable[[], int]) -> tuple[float, float]:
        """(regret, seconds) a step of `choice` is expected to add here, the drafter `behind` rows short: its
        cost (catch-up included) minus plain decoding's for the tokens the accept estimate (prior or measured)
        promises; (0, 0) while a cost is unknown."""
        cost, plain = self.costs.interpolate(bucket, choice), self.costs.interpolate(bucket, None)
        if cost is None or plain is None:
            return 0.0, 0.0
        rows = behind()
        cost += spread(self.catchup_seconds(bucket, rows), rows, bucket)
        return cost - max(1.0, self.accept.mean(bucket, choice)) * plain, cost

    def catchup_seconds(self, bucket: int, rows: int) -> float:
        """Expected seconds to catch the drafter up on `rows` rows at this bucket (`CatchupCosts.seconds`)."""
        return self.catchup.seconds(bucket, rows, self.costs.interpolate(bucket, None))

    def _within_budget(self, bucket: int, choice: Strategy | None, behind: Callable[[], int]) -> Strategy | None:
        """`choice`, unless running it would put speculation over budget (what it has cost so far plus what
        this step is expected to cost) and `choice` is not proven to beat plain decoding by the accept length
        and cost measured so far, its catch-up included (`switch_seconds`); then plain decoding. Counting the
        step before it runs keeps a costly first try (an SD step at a large batch can cost several plain
        steps) out of a bucket until enough plain decoding time has passed there to pay for it."""
        if choice is None or not self.over_budget(bucket, *self._expected_regret(bucket, choice, behind)):
            return choice
        accept = self.accept.measured(bucket, choice)
        cost, plain = self.costs.interpolate(bucket, choice), self.costs.interpolate(bucket, None)
        if accept is not None and cost is not None and plain is not None:
            if accept / (cost + self.switch_seconds(bucket, bucket, behind())) > (1 + self.hysteresis) / plain:
                return choice
        self._counts["held_back"] += 1
        return None

    def _explore_chance(self, bucket: int, cur: Strategy | None, other: Strategy | None, behind) -> float:
        """Probability that a drawn exploration of `other` goes ahead: 1 unless it costs more than the budget.
        Per step, P(explore other) * (extra seconds) <= explore_budget * incumbent seconds / len(others);
        a strategy's extra seconds include its catch-up of the `behind()` rows (`switch_seconds`)."""
        if self.explore_budget is None:
            return 1.0
        c_cur, c_other = self.costs.interpolate(bucket, cur), self.costs.interpolate(bucket, other)
        extra = c_other - c_cur + (0.0 if other is None else self.switch_seconds(bucket, bucket, behind()))
        if extra <= 0:
            return 1.0
        return min(1.0, self.budget(bucket) * c_cur / (self.epsilon * extra))
