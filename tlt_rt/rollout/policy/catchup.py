"""What catching the drafter up costs, as the SD policy learns it per batch bucket.

A plain decoding step leaves the drafter one row behind on every sequence; the next speculative step first
runs the rows beyond its catch-up window eagerly (`DrafterRunner.prepare`). The policy is told how many
rows that is (`behind`) and learns seconds per row from the steps that paid such a catch-up, apart from the
strategy's steady step cost. Until a bucket has measured one, CATCHUP_PRIOR stands in where a step's
regret is counted; where a decision weighs the catch-up against speculating at all, only a measured cost
counts (`CatchupCosts.per_step`).
"""

from __future__ import annotations

from collections.abc import Callable

# seconds per caught-up drafter row, as a share of a plain step's seconds per sequence, until measured
CATCHUP_PRIOR = 0.25
# the most one catch-up is believed to cost, in plain steps of its bucket: CAP_STEPS (an eager drafter forward is a
# few launch-bound plain steps whatever its rows) plus CAP_ROW per row as a share of a plain step's seconds per
# sequence. Measured catch-ups stay well inside it (1.5B, batch 128: ~10 plain steps for 10,000 rows, the cap ~85;
# batch 1-8: 1-5 plain steps); a step past it carried something else: a kernel compiled on first use made one
# 2-row catch-up at batch 1 read as 0.55 s a row, which held speculation back for the rest of the call.
CAP_STEPS, CAP_ROW = 6.0, 1.0


def rows_once(behind: int | Callable[[], int]) -> Callable[[], int]:
    """`behind` (rows, or a callable counting them) as a callable that counts at most once."""
    if not callable(behind):
        return lambda: behind
    seen: list[int] = []

    def rows() -> int:
        if not seen:
            seen.append(behind())
        return seen[0]

    return rows


def capped(extra_seconds: float, rows: int, bucket: int, plain: float | None) -> float:
    """A catch-up's measured excess, at most CAP_STEPS + CAP_ROW x rows / bucket plain steps (`plain`: a plain
    step's seconds at this bucket; no cap while it is unknown)."""
    if plain is None:
        return extra_seconds
    return min(extra_seconds, plain * (CAP_STEPS + CAP_ROW * rows / max(1, bucket)))


def spread(seconds: float, rows: int, batch_size: int) -> float:
    """A catch-up's `seconds` spread over a stretch of speculation as long as the plain one that left its `rows`
    behind (about rows / batch steps): what each step of that stretch pays for it. Counted whole in one step, the
    catch-up of a long plain stretch grew faster than the regret budget its plain steps earned (a batch of 128
    leaves 128 rows a step; at the prior's 0.25 of a plain step per row that is 32 plain steps' regret a step
    against the budget's 0.02), so one dear first try kept speculation out of that bucket for good."""
    return seconds / max(1.0, rows / batch_size)


class CatchupCosts:
    """Per bucket, faded sums of [extra seconds, rows] of the catch-ups steps have paid."""

    def __init__(self):
        self.seen: dict[int, list[float]] = {}

    def observe(self, bucket: int, extra_seconds: float, rows: int) -> None:
        seen = self.seen.setdefault(bucket, [0.0, 0.0])
        seen[0] = seen[0] * 0.5 + max(0.0, extra_seconds)
        seen[1] = seen[1] * 0.5 + rows

    def per_row(self, bucket: int) -> float | None:
        seen = self.seen.get(bucket)
        return seen[0] / seen[1] if seen is not None and seen[1] > 0 else None

    def seconds(self, bucket: int, rows: int, plain: float | None) -> float:
        """Expected seconds to catch up `rows` rows: measured per row, else CATCHUP_PRIOR x a plain step's
        seconds per sequence (`plain`: a plain step's seconds at this bucket); 0 if neither is known."""
        if rows <= 0:
            return 0.0
        per_row = self.per_row(bucket)
        if per_row is not None:
            return rows * per_row
        return 0.0 if plain is None else rows * CATCHUP_PRIOR * plain / bucket

    def per_step(self, bucket: int, batch_size: int, rows: int) -> float:
        """What catching up `rows` rows adds to each step of a stretch of speculation, the stretch assumed
        as long as the plain one that left the rows behind (about rows / batch steps): the rule that buys
        once a rent paid so far would have bought. Per step that is the per-row cost times the batch, however
        long plain decoding ran, so a long plain stretch does not lock speculation out. Measured costs only
        (0 until a catch-up step ran in this bucket): the prior is far too dear at small batches, where a
        catch-up is one eager drafter forward whatever its rows."""
        per_row = self.per_row(bucket)
        if rows <= 0 or per_row is None:
            return 0.0
        return spread(rows * per_row, rows, batch_size)

    def us_per_row(self) -> dict[int, float]:
        return {b: 1e6 * t / n for b, (t, n) in sorted(self.seen.items()) if n > 0}

    def state_dict(self) -> dict:
        return {str(b): list(v) for b, v in self.seen.items()}

    def load_state_dict(self, state: dict) -> None:
        self.seen = {int(b): list(v) for b, v in state.items()}
