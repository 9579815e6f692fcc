"""What the SD policy reports and saves: its counters as `stats`, what it learned as a state dict.

Kept apart from the decisions (rollout/policy/sd_policy.py), which neither feeds back into: `stats` goes to the run's
records and report, `state_dict` / `load_state_dict` carry the policy across a checkpoint.
"""

from __future__ import annotations

from collections import Counter

from tlt_rt.rollout.policy.costs import CostTable


class PolicyState:
    """`SDPolicy`'s reporting and persistence, over the attributes its constructor sets."""

    def stats(self) -> dict:
        """Counts of each kind of decision, per-bucket regret shares and incumbents, and accept lengths."""
        return {
            "mode": self.mode,
            "decisions": self._counts["decisions"],
            "explore_steps": self._counts["explore"],
            "measure_steps": self._counts["measure"],
            "plain_timing_steps": self._counts["plain_timing"],
            "switch_readings": self._counts["switch_readings"],
            "switches": self._counts["switches"],
            "follow_up_steps": self._counts["follow_ups"],
            "held_back_steps": self._counts["held_back"],
            "regret_share": {b: r / e for b, (r, e) in sorted(self._regret.items()) if e > 0},
            "losing_tries": {b: n for b, n in sorted(self._lost.items()) if n},  # in a row, against plain decoding
            "catchup_us_per_row": self.catchup.us_per_row(),
            "strategy_use": dict(self._use),
            "current": {b: self._current[b] for b in sorted(self._current)},
            "accept_mean": {str(s): self.accept.pooled_mean(s) for s in self.strategies},
            "accept_hist": self.accept.histogram(),
        }

    def state_dict(self) -> dict:
        """What the policy learned, JSON-safe. Mode, epsilon and hysteresis are configuration and stay
        as constructed on load; the seed and per-bucket counters travel so decisions replay exactly."""
        return {
            "version": 1,
            "strategies": [str(s) for s in self.strategies],
            "buckets": list(self.buckets),
            "seed": self.seed,
            "costs": self.costs.to_dict(),
            "accept": self.accept.state_dict(),
            "current": {str(b): name for b, name in self._current.items()},
            "calls": {str(b): n for b, n in self._calls.items()},
            "use": dict(self._use),
            "counts": dict(self._counts),
            "regret": {str(b): list(v) for b, v in self._regret.items()},
            "lost": {str(b): n for b, n in self._lost.items()},
            "catchup": self.catchup.state_dict(),
            "plain_at": {str(b): n for b, n in self._plain_at.items()},
            "plain_run": self._plain_run,
            "follow": None if self._follow is None else list(self._follow),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take up a `state_dict`; ValueError if it was saved for other strategies or buckets."""
        mine = [str(s) for s in self.strategies]
        if state.get("version") != 1:
            raise ValueError("not a version-1 SDPolicy state")
        if state["strategies"] != mine or state["buckets"] != self.buckets:
            raise ValueError(
                f"SDPolicy state is for strategies {state['strategies']} and buckets {state['buckets']}, "
                f"this policy has {mine} and {self.buckets}"
            )
        self.seed = state["seed"]
        self.costs = CostTable.from_dict(state["costs"])
        self.accept.load_state_dict(state["accept"])
        self._current = {int(b): name for b, name in state["current"].items()}
        self._calls = Counter({int(b): n for b, n in state["calls"].items()})
        self._use = Counter(state["use"])
        self._counts = Counter(state["counts"])
        self._regret = {int(b): list(v) for b, v in state.get("regret", {}).items()}
        self._lost = Counter({int(b): n for b, n in state.get("lost", {}).items()})
        self.catchup.load_state_dict(state.get("catchup", {}))
        self._plain_at = {int(b): n for b, n in state.get("plain_at", {}).items()}
        self._plain_run = int(state.get("plain_run", self.plain_settle + 1))
        follow = state.get("follow")
        self._follow = None if not follow else (int(follow[0]), str(follow[1]))
