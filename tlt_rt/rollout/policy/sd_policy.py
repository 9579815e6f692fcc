"""The speculative-decoding policy: per decode step, plain decoding or which strategy.

The choice maximises expected throughput at the current batch bucket,

    tokens/s(s) = batch * E[tokens per sequence per step | s] / step_seconds(bucket, s),

where plain decoding emits exactly one token per sequence per step. Step costs come from a `CostTable`
(profiled ahead by compile.py, refined online); accept lengths come from `AcceptStats`. Around the argmax
sits a small bandit: unmeasured options are tried first, an epsilon share of steps explores, and
hysteresis keeps the choice from flapping between near-equal options.

In "auto" mode speculation also has to pay its way in every batch bucket: each speculative step's regret
(its time minus what plain decoding would have taken for the tokens it emitted) is summed per bucket, and
while a bucket's sum is above `explore_budget` of that bucket's decode time, only strategies whose
measured accept length (not a prior) and cost beat plain decoding may run there. A drafter that does not
help thus costs at most that share of the time at each batch size, however many strategies there are to
try, plus one first trial per bucket; and less while it keeps losing there: a try against a plain
incumbent that leaves the strategy losing (steady cost against accept length, as measured) halves the
bucket's budget, down to a quarter (BACKOFF_HALVINGS), and one that leaves it winning restores it (a losing
bucket then costs ~0.5% instead of ~2%; a drafter that starts to pay takes it ~1,950 steps later, not ~600).

Switching from plain decoding to a strategy re-prefills nothing: the engine keeps the target hidden
states and catches the drafter up on the rows it missed at the next speculative step. That catch-up is not
free (an eager drafter forward over every missed row: at batch 128 after ~40 plain steps it tripled an SD
step on an H200), so the engine says how many rows the drafter is behind (`behind`); the policy learns a
cost per row per bucket from the steps that paid one (rollout/policy/catchup.py), keeps those steps out of the
strategy's steady step cost, and weighs the catch-up per step of the speculative stretch it opens (as long as
the plain stretch that left the rows behind) wherever it counts: in a step's regret, expected and paid, when
leaving plain decoding, exploring, or letting a strategy prove itself over budget. A try that pays a catch-up
runs a second step, whose time is the strategy's own.

What the policy reports and saves (`stats`, `state_dict`) is in rollout/policy/state.py.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

from tlt_rt.ir.strategy import Strategy, bucket_for
from tlt_rt.rollout.config import PolicyConfig
from tlt_rt.rollout.policy.accept_stats import AcceptStats
from tlt_rt.rollout.policy.budget import SpeculationBudget
from tlt_rt.rollout.policy.catchup import CatchupCosts, capped, rows_once, spread
from tlt_rt.rollout.policy.costs import CostTable, option_name
from tlt_rt.rollout.policy.state import PolicyState
from tlt_rt.rollout.step.rng import decision_uniform as _uniform

__all__ = ["AcceptStats", "SDPolicy"]

PLAIN_READINGS = 3  # plain decoding steps timed online per bucket before speculating there in auto mode


class SDPolicy(PolicyState, SpeculationBudget):
    """Decides, per decode step, plain decoding (None) or a `Strategy`.

    mode "off": always None. "auto": the option with the highest expected tokens/s among plain decoding
    and every strategy. "on": the same choice restricted to the strategies, so always speculative and with
    the best strategy by the cost model (the first configured one wins ties).
    Per bucket in "auto" mode, plain decoding is timed online PLAIN_READINGS times before any strategy runs (a
    profiled cost sees the graph alone, and one reading can be an outlier), and again every `plain_refresh`
    decisions while a strategy is chosen there: once speculation runs, plain steps would otherwise never be
    timed again, and an estimate that started high (in an RL rollout on Qwen2.5-1.5B the 48-64 buckets' stayed
    ~1.5x what SD-off decoding took there) keeps a losing strategy chosen. Only a plain step that follows
    `plain_settle` plain steps prices plain decoding once a bucket has a cost (`observe`): the first ones after a
    speculative step carry that step's leftovers (in an RL rollout on Qwen2.5-1.5B on an H200 the first cost up to
    17% more than the third and later ones, the second up to 6%, 20% once), so a timing step between speculative
    ones is a run of `plain_settle` + 1 plain steps, the last timed. Per bucket:
    an option without a usable cost (none, not even interpolated, or only a provisional first
    reading here) is measured first; otherwise with probability `epsilon` a uniformly drawn other option is
    explored; otherwise the current choice is kept unless the best option's expected tokens/s beats it by more
    than `hysteresis` (relative). `explore_budget` caps what exploring costs: an exploration step of an option
    dearer than the incumbent goes ahead only with a probability that keeps the expected extra time below that
    share of the incumbent's step time (an untrained drafter at batch 1, whose SD step costs ~2.7 plain steps
    and emits ~1 token, would otherwise cost epsilon * 1.7 = 8.5% of throughput), and the same budget bounds the
    summed regret of speculative steps (module docstring), over a window of the last `horizon` steps or so
    (older steps fade), so a lucky start does not license a long loss later. Estimates lean optimistic
    (interpolated costs err low, the accept prior is generous), so an untried option gets tried rather than shut
    out. A batch above the largest bucket is decided as the largest bucket.
    """

    def __init__(
        self,
        strategies: list[Strategy],
        buckets: list[int],
        costs: CostTable | None = None,
        mode: str = "auto",
        config: PolicyConfig | None = None,
        accept: AcceptStats | None = None,
        **overrides,
    ):
        # the knobs are declared once, in PolicyConfig (which validates them); overrides replace single ones
        cfg = dataclasses.replace(config if config is not None else PolicyConfig(), **overrides)
        epsilon, hysteresis, seed = cfg.epsilon, cfg.hysteresis, cfg.seed
        explore_budget, horizon = cfg.explore_budget, cfg.horizon
        self.plain_refresh, self.plain_settle = cfg.plain_refresh, cfg.plain_settle
        # plain steps observed in a row since the last prefill or speculative step (as if many, until one is seen)
        self._plain_run = cfg.plain_settle + 1
        self._plain_at: dict[int, int] = {}  # bucket -> its decision count at the last plain step there
        if mode not in ("off", "on", "auto"):
            raise ValueError(f"SDPolicy.mode must be 'off', 'on' or 'auto', got {mode!r}")
        if mode == "on" and not strategies:
            raise ValueError("SDPolicy.strategies must not be empty when mode is 'on'")
        if not buckets:
            raise ValueError("SDPolicy.buckets must not be empty")
        self.explore_budget = explore_budget
        self._fade = 1.0 - 1.0 / horizon
        # per bucket, faded sums of [speculative steps' (seconds - plain seconds for their tokens), all seconds]
        self._regret: dict[int, list[float]] = {}
        self._lost: Counter = Counter()  # bucket -> speculative steps in a row that lost to a plain incumbent
        self.strategies = list(strategies)
        self.buckets = sorted(buckets)
        self.costs = costs if costs is not None else CostTable()
        self.accept = accept if accept is not None else AcceptStats()
        self.mode, self.epsilon, self.hysteresis, self.seed = mode, epsilon, hysteresis, seed
        options: list[Strategy | None] = [] if mode == "off" else list(self.strategies)
        self.options = ([None] if mode == "auto" else []) + options
        self._by_name = {option_name(o): o for o in self.options}
        self._bucket_of: dict[int, int] = {}  # batch size -> bucket
        self._current: dict[int, str] = {}  # bucket -> name of the incumbent choice
        self._calls: Counter = Counter()  # bucket -> decisions made there (drives the random stream)
        self._use: Counter = Counter()  # name -> times returned
        self._counts: Counter = Counter()  # decisions / explore / measure / switches
        self.catchup = CatchupCosts()  # what catching the drafter up costs here, per bucket
        self._known: dict[int, int] = {}  # bucket -> the cost table's revision when every option had a cost
        # (bucket, strategy) of a try that paid a catch-up: the next decision, if it is there, runs it once more
        self._follow: tuple[int, str] | None = None

    def bucket(self, batch_size: int) -> int:
        b = self._bucket_of.get(batch_size)
        if b is None:
            b = self.buckets[-1] if batch_size > self.buckets[-1] else bucket_for(batch_size, self.buckets)
            self._bucket_of[batch_size] = b
        return b

    def expected_rate(self, batch_size: int, strategy: Strategy | None) -> float | None:
        """Expected tokens/s of an option at this batch size, or None while its cost is unknown."""
        return self._rate(batch_size, self.bucket(batch_size), strategy)

    def _rate(self, batch_size: int, bucket: int, strategy: Strategy | None) -> float | None:
        cost = self.costs.interpolate(bucket, strategy)
        return None if cost is None else batch_size * self.accept.mean(bucket, strategy) / cost

    def decide(self, batch_size: int, behind: int | Callable[[], int] = 0) -> Strategy | None:
        """Plain decoding (None) or a strategy for the next step of `batch_size` sequences, whose drafter is
        `behind` rows short in total (rows its next speculative step must catch up first); a callable is
        asked only when a strategy is weighed (counting the rows costs a pass over the batch)."""
        if self.mode == "off":
            return None
        rows = rows_once(behind)
        b = self.bucket(batch_size)
        n = self._calls[b]
        self._calls[b] += 1
        self._counts["decisions"] += 1
        follow, self._follow = self._follow, None
        if follow is not None and follow[0] == b:  # the second step of a try: no catch-up, so its own time
            choice = self._within_budget(b, self._by_name[follow[1]], rows)
            self._counts["follow_ups"] += choice is not None
            return self._use_option(choice)
        if self._known.get(b) != self.costs.revision:  # a bucket stays known until a cell turns provisional
            costs = self.costs
            unknown = [o for o in self.options if costs.interpolate(b, o) is None or costs.is_provisional(b, o)]
            if unknown:  # plain decoding comes first, so an unknown strategy held back falls to a known cost
                choice = self._within_budget(b, unknown[0], rows)
                if choice is unknown[0]:
                    self._counts["measure"] += 1
                    self._try(b, choice, rows)
                else:  # held back: plain decoding is the incumbent until the strategy can be afforded
                    self._current.setdefault(b, option_name(None))
                return self._use_option(choice)
            self._known[b] = self.costs.revision
        rates = {name: self._rate(batch_size, b, o) for name, o in self._by_name.items()}
        best = max(rates, key=rates.__getitem__)  # first configured option wins ties
        cur = self._current.get(b)
        if cur not in rates or rates[best] > rates[cur] * (1 + self.hysteresis):
            if cur is None or cur == best or self._worth_switching(batch_size, b, best, cur, rates, rows):
                if cur is not None and cur != best:
                    self._counts["switches"] += 1
                cur = self._current[b] = best
        choice = self._by_name[cur]
        if len(self.options) > 1 and _uniform(self.seed, b, 3 * n) < self.epsilon:
            others = [o for o in self.options if option_name(o) != cur]
            other = others[int(_uniform(self.seed, b, 3 * n + 1) * len(others))]
            if _uniform(self.seed, b, 3 * n + 2) < self._explore_chance(b, choice, other, rows):
                choice = other
                self._counts["explore"] += 1
        if (
            choice is not None
            and self.mode == "auto"
            and (
                self.costs.online_readings(b, None) < PLAIN_READINGS
                or (self.plain_refresh and n - self._plain_at.get(b, n) >= self.plain_refresh)
            )
        ):
            # plain decoding is the yardstick of every choice here and costs nothing against SD off to time
            self._counts["plain_timing"] += 1
            return self._use_option(None)
        choice = self._within_budget(b, choice, rows)
        if choice is not None and option_name(choice) != cur:
            self._try(b, choice, rows)
        return self._use_option(choice)

    def _try(self, bucket: int, strategy: Strategy, rows: Callable[[], int]) -> None:
        """A step trying `strategy` away from the incumbent: where it first catches the drafter up, the next
        decision here runs it once more. The catch-up step teaches the per-row catch-up cost only (`observe`),
        so a try of one step after a plain stretch never reads the strategy's own cost: a first reading that
        ran cold (an H200 read 8_4_8 at batch 128 as 16.9 ms against 7.2 ms steady) then stood, and the
        strategy never looked worth switching to."""
        if self.mode == "auto" and rows() > 0:
            self._follow = (bucket, option_name(strategy))

    def _worth_switching(self, batch_size: int, bucket: int, best: str, cur: str, rates: dict, rows) -> bool:
        """Whether leaving plain decoding for strategy `best` still beats staying once its catch-up is paid
        (`switch_seconds`); other switches always are."""
        strategy = self._by_name[best]
        if cur != option_name(None) or strategy is None:
            return True
        extra = self.switch_seconds(bucket, batch_size, rows())
        if extra <= 0:
            return True
        cost = self.costs.interpolate(bucket, strategy) + extra
        return batch_size * self.accept.mean(bucket, strategy) / cost > rates[cur] * (1 + self.hysteresis)

    def switch_seconds(self, bucket: int, batch_size: int, rows: int) -> float:
        """Seconds a catch-up of `rows` rows adds to each step of speculating from here (`CatchupCosts.per_step`)."""
        return self.catchup.per_step(bucket, batch_size, rows)

    def _use_option(self, option: Strategy | None) -> Strategy | None:
        self._use[option_name(option)] += 1
        return option

    def observe(
        self,
        batch_size: int,
        strategy: Strategy | None,
        seconds: float,
        tokens_per_seq: float,
        behind: int = 0,
        switched: bool = False,
    ) -> None:
        """Record one executed step: its wall time, the tokens it emitted per sequence, the drafter rows
        it caught up first (`behind`, as given to `decide`) and whether the step before it was of another
        kind (`switched`: a speculative step or a prefill before a plain one).

        A plain step soon after another kind carries that step's leftovers into its time (device work it
        left queued, the host's caches cold after a speculative step's host work), so once the bucket has a cost
        the first `plain_settle` plain steps after a switch do not price plain decoding (`switch_readings` in
        `stats`): a plain timing step between speculative ones (`plain_refresh`, the first PLAIN_READINGS)
        stays due, and the next plain step that follows as many plain ones is timed instead."""
        b = self.bucket(batch_size)
        self._plain_run = 0 if strategy is not None else 1 if switched else self._plain_run + 1
        if strategy is None and self._plain_run <= self.plain_settle and self.costs.get(b, None) is not None:
            self._counts["switch_readings"] += 1
        elif strategy is None:
            self._plain_at[b] = self._calls[b]
            self.costs.observe(b, None, seconds)
        plain = self.costs.interpolate(b, None)
        charged = seconds  # what the step's regret counts: a catch-up's excess spread over the stretch it opens
        if strategy is not None:
            steady = None
            if behind > 0 and not self.costs.is_provisional(b, strategy):
                steady = self.costs.interpolate(b, strategy)
            if steady is None:
                self.costs.observe(b, strategy, seconds)
            elif seconds < steady:  # a catch-up only adds time: the steady cost itself was read high
                self.costs.observe(b, strategy, seconds)
                self.catchup.observe(b, 0.0, behind)
            else:  # a catch-up step: its excess over the steady cost teaches the per-row catch-up cost only
                extra = capped(seconds - steady, behind, b, plain)  # (a one-off stall is not a catch-up's cost)
                self.catchup.observe(b, extra, behind)
                charged = steady + spread(extra, behind, b)
        acc = self._regret.setdefault(b, [0.0, 0.0])
        acc[0] *= self._fade
        acc[1] = acc[1] * self._fade + seconds
        if strategy is not None:
            self.accept.observe(b, strategy, tokens_per_seq)
            if plain is not None:
                acc[0] += charged - max(1.0, tokens_per_seq) * plain
                # a try against a plain incumbent, lost or won; one that caught the drafter up first is judged
                # by the step after it (`_try`), which reads the strategy's own time
                if self._current.get(b) == option_name(None) and behind == 0:
                    own = self.costs.interpolate(b, strategy)  # its steady cost, a catch-up's excess apart
                    lost = own is not None and own > max(1.0, self.accept.mean(b, strategy)) * plain
                    self._lost[b] = self._lost[b] + 1 if lost else 0
