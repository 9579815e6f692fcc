"""Per-step metrics: `runs/<name>/metrics.jsonl` (one JSON object per RL step), per-worker timelines
(`timelines.jsonl`), and the optional loggers of train/loggers.py (TensorBoard, wandb).

Timeline segments are (kind, start, end) in seconds from the step's rollout start, kinds:
  generating  plain prefill/decode steps        sd        speculative steps
  idle        share done, nothing to do        drafter   drafter training (idle worker, or own tail)
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tlt_rt.train.rl.loggers import TensorBoardLogger, check_loggers

# the tail: fewer than a quarter of a worker's full batch (its sequences, or the engine's max_batch when
# smaller) still running
TAIL_FRACTION = 0.25
ENGINE_KINDS = {"prefill": "generating", "decode": "generating", "sd": "sd"}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def tail_seconds(timeline: Iterable[dict], capacity: int, fraction: float = TAIL_FRACTION) -> tuple[float, float]:
    """(seconds of decode/SD steps whose batch was under `fraction` of `capacity`, all step seconds)."""
    tail = total = 0.0
    for e in timeline:
        total += e["seconds"]
        if e["kind"] != "prefill" and e["batch"] < fraction * capacity:
            tail += e["seconds"]
    return tail, total


def sd_seconds(timeline: Iterable[dict]) -> tuple[float, float]:
    """(seconds in speculative steps, seconds in decode + speculative steps)."""
    sd = dec = 0.0
    for e in timeline:
        if e["kind"] == "sd":
            sd += e["seconds"]
        if e["kind"] in ("sd", "decode"):
            dec += e["seconds"]
    return sd, dec


def engine_segments(timeline: Sequence[dict], start: float, end: float) -> list[list]:
    """Merge consecutive engine steps into [kind, start, end] bars spanning [start, end].

    Step records carry durations but not timestamps, so bars are laid end to end and stretched over the
    measured wall time (the scheduler's host work between steps is shared out proportionally).
    """
    busy = sum(e["seconds"] for e in timeline)
    if busy <= 0 or end <= start:
        return [["generating", start, end]] if end > start else []
    scale = (end - start) / busy
    out: list[list] = []
    t = start
    for e in timeline:
        kind = ENGINE_KINDS.get(e["kind"], "generating")
        t1 = t + e["seconds"] * scale
        if out and out[-1][0] == kind:
            out[-1][2] = t1
        else:
            out.append([kind, t, t1])
        t = t1
    out[-1][2] = end
    return out


def worker_timeline(rollout: dict, training: dict | None, step_end: float) -> list[list]:
    """One worker's bars for a step: its engine bars, then idle/drafter until the rollout's end.

    `rollout` holds start/end (seconds from the step start) and the engine timeline; `training` holds
    the idle-time training's start/end when the coordinator gave it some. Tail training (single worker)
    overlaps generation and arrives as rollout["tail_training"] = [start, end].
    """
    bars = engine_segments(rollout["timeline"], rollout["start"], rollout["end"])
    t = rollout["end"]
    if training and training.get("steps", 0) > 0:
        if training["start"] > t:
            bars.append(["idle", t, training["start"]])
        bars.append(["drafter", training["start"], training["end"]])
        t = training["end"]
    if step_end > t:
        bars.append(["idle", t, step_end])
    tail = rollout.get("tail_training")
    if tail:
        bars.append(["drafter", tail[0], tail[1]])
    return [[k, round(a, 4), round(b, 4)] for k, a, b in bars]


def batch_bucket(batch: int) -> int:
    """The power of two at or below `batch`: the rows a per-batch-size breakdown groups steps by."""
    return 1 << (max(batch, 1).bit_length() - 1)


def by_batch(timeline: Iterable[dict], into: dict[str, dict] | None = None) -> dict[str, dict]:
    """Decode and speculative steps summed per batch bucket: seconds of each, tokens emitted by each, and the
    sequence-steps of SD (accept length of a bucket = sd_tokens / sd_rows)."""
    out = {} if into is None else into
    for e in timeline:
        if e["kind"] not in ("decode", "sd"):
            continue
        row = out.setdefault(str(batch_bucket(e["batch"])), dict.fromkeys(
            ("decode_s", "sd_s", "decode_tokens", "sd_tokens", "sd_rows"), 0))  # fmt: skip
        if e["kind"] == "sd":
            row["sd_s"] += e["seconds"]
            row["sd_tokens"] += e["tokens"]
            row["sd_rows"] += e["batch"]
        else:
            row["decode_s"] += e["seconds"]
            row["decode_tokens"] += e["tokens"]
    return out


def plain_steps(timeline: Iterable[dict], into: dict[str, dict] | None = None) -> dict[str, dict]:
    """Plain decoding steps' seconds per batch bucket, by their place in their run of plain steps: the first
    after a prefill or a speculative step ("1"), the second ("2"), later ones ("3+"). What the SD policy prices
    plain decoding from (it leaves the first out) against what a run of plain steps costs once settled."""
    out = {} if into is None else into
    place = 0
    for e in timeline:
        if e["kind"] != "decode":
            place = 0
            continue
        place += 1
        key = "1" if place == 1 else "2" if place == 2 else "3+"
        out.setdefault(str(batch_bucket(e["batch"])), {}).setdefault(key, []).append(e["seconds"])
    return out


def plain_step_summary(by_bucket: dict[str, dict]) -> dict[str, dict]:
    """`plain_steps`' lists as {bucket: {place: [steps, median ms]}}."""
    out = {}
    for b, places in sorted(by_bucket.items(), key=lambda kv: int(kv[0])):
        out[b] = {k: [len(v), 1e3 * percentile(v, 50)] for k, v in sorted(places.items()) if v}
    return out


def rollout_metrics(rollouts: Sequence, rollout_seconds: float) -> dict[str, Any]:
    """Aggregate engine statistics of one step's rollout over workers."""
    tail = busy = sd = dec = 0.0
    tokens = 0
    hist: dict[str, int] = {}
    strategies: dict[str, int] = {}
    buckets: dict[str, dict] = {}
    per_worker: list[dict[str, dict]] = []
    plain: dict[str, dict] = {}
    for r in rollouts:
        per_worker.append(by_batch(r.timeline))
        for b, row in per_worker[-1].items():
            pooled = buckets.setdefault(b, dict.fromkeys(row, 0))
            for k, v in row.items():
                pooled[k] += v
        plain_steps(r.timeline, plain)
        a, b = tail_seconds(r.timeline, r.capacity)
        tail, busy = tail + a, busy + b
        a, b = sd_seconds(r.timeline)
        sd, dec = sd + a, dec + b
        tokens += r.stats.get("generated_tokens", 0)
        for k, v in r.stats.get("accept_length_hist", {}).items():
            hist[str(k)] = hist.get(str(k), 0) + int(v)
        for k, v in r.stats.get("strategy_use", {}).items():
            strategies[k] = strategies.get(k, 0) + int(v)
    n_sd = sum(hist.values())
    return {
        "rollout_seconds": rollout_seconds,
        "tail_share": tail / busy if busy else 0.0,
        "sd_share": sd / dec if dec else 0.0,
        "accept_length": sum(int(k) * v for k, v in hist.items()) / n_sd if n_sd else None,
        "accept_length_hist": hist,
        "strategy_use": strategies,
        "batch_buckets": dict(sorted(buckets.items(), key=lambda kv: int(kv[0]))),
        # the same per worker (in the order of worker_rollout_seconds): which worker decoded the lone tail
        "batch_buckets_by_worker": per_worker if len(rollouts) > 1 else None,
        # plain steps' median time per bucket by place after a prefill or SD step (plain_steps)
        "plain_step_ms": plain_step_summary(plain),
        "generated_tokens": tokens,
        "tokens_per_second": tokens / rollout_seconds if rollout_seconds > 0 else 0.0,
    }


def spot_metrics(trainings: Sequence, idle_seconds: float) -> dict[str, Any]:
    """Drafter training of one step: steps, loss and top-1 agreement with the target (weighted by steps),
    worker-seconds harvested from idle workers (tail training overlaps generation, so it harvests none)."""
    steps = sum(t.steps for t in trainings)
    harvested = sum(t.seconds for t in trainings if t.where == "idle")

    def weighted(key: str) -> float | None:
        pairs = [(getattr(t, key), t.steps) for t in trainings if getattr(t, key) is not None and t.steps > 0]
        w = sum(s for _, s in pairs)
        return sum(v * s for v, s in pairs) / w if w else None

    return {
        "spot_steps": steps,
        "spot_workers": sum(1 for t in trainings if t.steps > 0),
        "drafter_loss": weighted("loss"),
        "drafter_top1": weighted("top1"),
        "idle_worker_seconds": idle_seconds,
        "harvested_worker_seconds": harvested,
    }


def stats_delta(after: dict, before: dict) -> dict:
    """Engine counters are cumulative over its life; one rollout's share is the difference."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and isinstance(b, int | float):
            out[k] = v - b
        elif isinstance(v, dict) and isinstance(b, dict):
            out[k] = {kk: vv - b.get(kk, 0) for kk, vv in v.items() if isinstance(vv, int | float)}
            out[k] = {kk: vv for kk, vv in out[k].items() if vv}
    return out


class MetricsWriter:
    """Appends step records; on resume, drops records of steps at or after the resumed step first.
    `loggers` (train/loggers.py) get every record too; `tensorboard=True` adds a TensorBoard logger."""

    def __init__(
        self, run_dir: str | Path, start_step: int = 0, tensorboard: bool = False, loggers: list | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.timeline_path = self.run_dir / "timelines.jsonl"
        for p in (self.path, self.timeline_path):
            _truncate_from(p, start_step)
        self.loggers = list(loggers or [])
        if tensorboard:
            check_loggers(["tensorboard"])
            self.loggers.append(TensorBoardLogger(self.run_dir / "tb"))

    def write(self, record: dict[str, Any], timelines: dict[str, list] | None = None) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        if timelines is not None:
            with self.timeline_path.open("a") as f:
                f.write(json.dumps({"step": record["step"], "workers": timelines}) + "\n")
        for logger in self.loggers:
            logger.log(record, record["step"])

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a .jsonl file. A last line cut short (a crash mid-write: no newline after it) is
    dropped with a warning; any other unreadable line is a ValueError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        return []
    text = p.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):  # the last line has no newline after it: a write cut short
                warnings.warn(f"{p}: line {i} was cut short (a crash mid-write?); it is ignored", stacklevel=2)
                continue
            raise ValueError(f"{p}: line {i} is not valid JSON ({e.msg}); fix or delete that line") from e
    return out


def _truncate_from(path: Path, step: int) -> None:
    """Keep records of steps before `step`, rewriting the file atomically (a crash leaves old or new, whole)."""
    if not path.is_file():
        return
    keep = [r for r in read_jsonl(path) if r.get("step", -1) < step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in keep))
    os.replace(tmp, path)
