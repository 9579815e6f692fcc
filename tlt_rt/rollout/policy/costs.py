"""Measured seconds per step, per (batch bucket, plain decoding or strategy), and what they are valid for.

`tlt_rt.compile` profiles every bucket ahead and saves the table under the cache dir keyed by `cost_key`
(model shape, dtype, device, torch/triton versions); the engine loads it at start, profiles missing cells
lazily, and refines cells online from the steps it times (an EMA with outliers clipped). A profiled cost
times the graphs alone (no host work, acceptance or commit), so the first step timed online replaces it.
"""

from __future__ import annotations

import itertools
import json
import math
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tlt_rt.ir.strategy import Strategy

OFF = "off"  # name of plain decoding wherever options are keyed by name
# a reading below estimate / LOW_READING replaces the estimate: step times have a hard floor and upward noise,
# so such a reading says the estimate was an outlier (a first 8_4_8 step at batch 128 read 16.9 ms against 7.2
# ms steady on an H200)
LOW_READING = 1.5
_REVISIONS = itertools.count()


def option_name(strategy: Strategy | None) -> str:
    return OFF if strategy is None else str(strategy)


def cost_key(model_shape: dict, dtype: object, device: object) -> dict:
    """What a measured cost table is only valid for: model shape, dtype, device name, torch/triton versions."""
    import torch  # local: only the key reads torch's version; the table itself is plain JSON

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    try:
        triton = version("triton")
    except PackageNotFoundError:  # CPU-only installs may lack triton
        triton = None
    return {
        "model": dict(model_shape),
        "dtype": str(dtype),
        "device": name,
        "torch": torch.__version__,
        "triton": triton,
    }


class CostTableMismatch(ValueError):
    """A saved cost table was measured for another model, dtype, device or software version."""


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return value


class CostTable:
    """Seconds per step for each (batch bucket, strategy or None for plain decoding)."""

    def __init__(self, key: dict | None = None, alpha: float = 0.2, clip: float = 3.0):
        if not 0 < alpha <= 1 or clip <= 1:
            raise ValueError(f"CostTable needs 0 < alpha <= 1 and clip > 1, got alpha={alpha}, clip={clip}")
        self.key = json.loads(json.dumps(key or {}))  # normalised so saved and fresh keys compare equal
        self.alpha, self.clip = alpha, clip
        self._costs: dict[str, dict[int, float]] = {}
        self._provisional: set[tuple[str, int]] = set()  # cells whose only reading may be a warm-up step
        self._online: dict[tuple[str, int], int] = {}  # steps timed online per cell
        self._bounds: dict[str, dict[int, float]] = {}  # per option: each measured bucket's cost, capped (interpolate)
        # changes when a cell appears or turns provisional; unique across tables, so a reader can cache
        # what it derived from the cells' presence (the SD policy: which buckets have every cost)
        self.revision = next(_REVISIONS)

    def get(self, bucket: int, strategy: Strategy | None) -> float | None:
        """The measured cost, or None (see `interpolate` for an estimate)."""
        return self._costs.get(option_name(strategy), {}).get(bucket)

    def set(self, bucket: int, strategy: Strategy | None, seconds: float) -> None:
        """Record a trusted cost (a profiled median, say); the first step timed online replaces it."""
        name = option_name(strategy)
        self._costs.setdefault(name, {})[int(bucket)] = _positive("seconds", seconds)
        self._bounds.pop(name, None)
        self._provisional.discard((name, int(bucket)))
        self._online.pop((name, int(bucket)), None)
        self.revision = next(_REVISIONS)

    def online_readings(self, bucket: int, strategy: Strategy | None) -> int:
        """Steps of this cell timed online (0 for a profiled or empty cell)."""
        return self._online.get((option_name(strategy), bucket), 0)

    def is_provisional(self, bucket: int, strategy: Strategy | None) -> bool:
        """True while the cell's only reading is the first online one (it may include compilation or
        CUDA-graph capture); the policy measures such a cell once more before trusting it."""
        return (option_name(strategy), bucket) in self._provisional

    def observe(self, bucket: int, strategy: Strategy | None, seconds: float) -> float:
        """Fold one measured step into the estimate; returns the new estimate.

        The first online reading of an empty cell is provisional and the second replaces it outright; the
        first online reading of a profiled cell replaces the profile (which saw the graphs, not the whole
        step). After that a running mean until 1/alpha readings, then an EMA: step times have a hard floor
        and their noise is upward (host hiccups, allocator, preemption work), so a reading above
        clip x estimate is clipped, while one below estimate / LOW_READING means the estimate itself was an
        outlier and is replaced (a profiled cell's cold first reading would otherwise be averaged out over
        several more readings, each of which the SD policy must first afford).
        """
        seconds = _positive("seconds", seconds)
        name, bucket = option_name(strategy), int(bucket)
        cell, cur = (name, bucket), self.get(bucket, strategy)
        n = self._online.get(cell, 0) + 1
        if cur is None:
            self._provisional.add(cell)
            self.revision = next(_REVISIONS)
            new = seconds
        elif cell in self._provisional or n == 1 or seconds < cur / LOW_READING:
            self._provisional.discard(cell)
            new = seconds
        else:
            new = cur + max(1 / n, self.alpha) * (min(seconds, cur * self.clip) - cur)
        self._costs.setdefault(name, {})[bucket] = new
        self._bounds.pop(name, None)
        self._online[cell] = n
        return new

    def merge_missing(self, other: CostTable) -> None:
        """Copy every cell this table lacks from `other` (measured for the same key), as it is there."""
        for name, row in other._costs.items():
            for b, seconds in row.items():
                if b not in self._costs.get(name, {}):
                    self._costs.setdefault(name, {})[b] = seconds
                    self._bounds.pop(name, None)
                    cell = (name, b)
                    if cell in other._provisional:
                        self._provisional.add(cell)
                    if cell in other._online:
                        self._online[cell] = other._online[cell]
        self.revision = next(_REVISIONS)

    def __len__(self) -> int:
        """Cells with a cost."""
        return sum(len(row) for row in self._costs.values())

    def buckets(self, strategy: Strategy | None) -> list[int]:
        return sorted(self._costs.get(option_name(strategy), {}))

    def interpolate(self, bucket: int, strategy: Strategy | None) -> float | None:
        """Measured cost, else an estimate from the strategy's measured neighbours, else None.

        A measured cost is capped by the cheapest measured at a larger bucket: a larger batch never costs
        less, so such a reading was an outlier the estimate has not shed yet. That matters most for plain
        decoding, the yardstick: a bucket whose plain cost was inflated (a drafter trainer starting beside it,
        say) looks like speculation pays there, and once the policy speculates there it no longer times plain
        decoding to correct it.

        Step cost is close to linear in batch between buckets, so a bucket between two measured ones is
        interpolated linearly; above the largest measured bucket the last segment's slope (at least 0)
        extends it, or the cost stays flat when only one bucket is measured. Below the smallest measured
        bucket a strategy's cost there is scaled by plain decoding's cost ratio between the two buckets,
        once plain decoding is measured at both and they are at most 4x apart (a batch that shrinks as requests
        finish visits ever smaller buckets, and measuring every strategy afresh in each would cost more than
        it tells; further apart, a verify that is compute-bound at the larger batch would look far dearer
        than it is); otherwise None. Estimates err low where they can (cost grows with batch): an option
        that looks good on an estimate gets picked and thereby measured, while a pessimistic guess could
        shut it out for good.
        """
        row = self._bounded(option_name(strategy))
        if bucket in row:
            return row[bucket]
        xs = sorted(row)
        if not xs:
            return None
        if bucket < xs[0]:
            plain = self._bounded(OFF)
            if strategy is None or bucket not in plain or xs[0] not in plain or xs[0] > 4 * bucket:
                return None
            return row[xs[0]] * min(1.0, plain[bucket] / plain[xs[0]])
        if bucket > xs[-1]:
            if len(xs) == 1:
                return row[xs[0]]
            x0, x1 = xs[-2], xs[-1]
            slope = max(0.0, (row[x1] - row[x0]) / (x1 - x0))
            return row[x1] + slope * (bucket - x1)
        hi = next(x for x in xs if x > bucket)
        lo = max(x for x in xs if x < bucket)
        t = (bucket - lo) / (hi - lo)
        return row[lo] + t * (row[hi] - row[lo])

    def _bounded(self, name: str) -> dict[int, float]:
        """The option's measured costs, each capped by the cheapest at a larger bucket (kept until one changes)."""
        bounds = self._bounds.get(name)
        if bounds is None:
            row, bounds, low = self._costs.get(name, {}), {}, math.inf
            for x in sorted(row, reverse=True):
                low = bounds[x] = min(row[x], low)
            self._bounds[name] = bounds
        return bounds

    # ------------------------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        costs = {name: {str(b): s for b, s in sorted(row.items())} for name, row in sorted(self._costs.items())}
        provisional = sorted([name, b] for name, b in self._provisional)
        online = sorted([name, b, n] for (name, b), n in self._online.items())
        return {
            "version": 1,
            "key": self.key,
            "alpha": self.alpha,
            "clip": self.clip,
            "costs": costs,
            "provisional": provisional,
            "online": online,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostTable:
        if data.get("version") != 1 or not isinstance(data.get("costs"), dict):
            raise ValueError("not a version-1 cost table (expected keys 'version': 1, 'key', 'costs')")
        table = cls(data.get("key"), data.get("alpha", 0.2), data.get("clip", 3.0))
        for name, row in data["costs"].items():
            for b, s in row.items():
                table._costs.setdefault(name, {})[int(b)] = _positive(f"cost of {name} at bucket {b}", s)
        table._provisional = {(name, int(b)) for name, b in data.get("provisional", [])}
        table._online = {(c[0], int(c[1])): int(c[2]) if len(c) > 2 else 1 for c in data.get("online", [])}
        table.revision = next(_REVISIONS)
        return table

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path, key: dict | None = None, strict: bool = False) -> CostTable | None:
        """Read a saved table. If `key` is given and differs from the saved one, the measurements do not
        apply here: return None (the caller profiles afresh), or raise `CostTableMismatch` when `strict`."""
        try:
            table = cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"cost table {path} is not valid JSON: {e}") from e
        if key is not None:
            want = json.loads(json.dumps(key))
            diff = sorted(k for k in set(want) | set(table.key) if want.get(k) != table.key.get(k))
            if diff:
                if strict:
                    details = ", ".join(f"{k}: saved {table.key.get(k)!r}, here {want.get(k)!r}" for k in diff)
                    raise CostTableMismatch(f"cost table {path} was measured elsewhere ({details})")
                return None
        return table
