"""A run's step records as the comparison page reads them: the measured steps, the column means, the speedup
with its standard error, whether learning agrees, the drafter curve, the updates that compiled mid-run."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from tlt_rt.train.rl.metrics import read_jsonl

# (metrics key, column heading, format)
COLUMNS = (
    ("step_seconds", "step s", ".2f"),
    ("rollout_seconds", "rollout s", ".2f"),
    ("rollout_share", "rollout share", ".0%"),
    ("tail_share", "tail share", ".0%"),
    ("worker_gap_seconds", "workers' gap s", ".2f"),
    ("learner_seconds", "learner s", ".2f"),
    ("learner_update_seconds", "update s", ".2f"),
    ("learner_tokens_per_second", "learner tok/s", ".0f"),
    ("learner_mfu", "learner MFU", ".0%"),
    ("gpu_peak_rollout_gib", "rollout GiB", ".1f"),
    ("gpu_peak_learn_gib", "learner GiB", ".1f"),
    ("gpu_reserved_rollout_gib", "rollout GiB held", ".1f"),
    ("gpu_reserved_learn_gib", "learner GiB held", ".1f"),
    ("sd_share", "SD share", ".0%"),
    ("accept_length", "accept", ".2f"),
    ("accept_ceiling", "ceiling", ".2f"),
    ("spot_steps", "spot steps", ".1f"),
    ("harvested_worker_seconds", "harvested s", ".1f"),
    ("tokens_per_second", "tok/s", ".0f"),
    ("reward_mean", "reward", ".3f"),
)
HIST_STEPS = 3  # the length histogram pools the first steps, before the policy has moved much


def load_run(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    records = read_jsonl(path)
    if not records:
        raise ValueError(f"{path} has no steps")
    return records


def measured(records: list[dict], warmup: int = 1) -> list[dict]:
    """The steps that count for timing: those after the first `warmup`, or all when there are no more."""
    return records[warmup:] if len(records) > warmup else records


def values(records: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), int | float)]


def run_means(records: list[dict], warmup: int = 1) -> dict[str, float | None]:
    """Mean of each column over the run's measured steps."""
    rows = measured(records, warmup)
    out: dict[str, float | None] = {}
    for key, _, _ in COLUMNS:
        vals = values(rows, key)
        out[key] = statistics.fmean(vals) if vals else None
    return out


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (0 for fewer than two values)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def speedup(base: list[dict], run: list[dict], warmup: int = 1) -> tuple[float, float] | None:
    """Mean base step time over mean run step time, and its standard error (delta method over the two
    means' standard errors); None without step times."""
    a, b = values(measured(base, warmup), "step_seconds"), values(measured(run, warmup), "step_seconds")
    if not a or not b:
        return None
    (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
    if mb <= 0:
        return None
    ratio = ma / mb
    return ratio, ratio * math.hypot(sa / ma if ma else 0.0, sb / mb)


def compare_table(runs: dict[str, list[dict]], warmup: int = 1) -> list[str]:
    names = list(runs)
    base = runs[names[0]]
    head = "| run | steps | " + " | ".join(h for _, h, _ in COLUMNS) + " | speedup |"
    md = [head, "|---|---:|" + "---:|" * (len(COLUMNS) + 1)]
    for n in names:
        m = run_means(runs[n], warmup)
        cells = [("-" if m[k] is None else format(m[k], f)) for k, _, f in COLUMNS]
        sp = speedup(base, runs[n], warmup)
        speed = "-" if sp is None else f"{sp[0]:.2f}x ± {sp[1]:.2f}"
        md.append(f"| {n} | {len(runs[n])} | " + " | ".join(cells) + f" | {speed} |")
    return md


def _last_heldout(records: list[dict]) -> tuple[float, int] | None:
    for r in reversed(records):
        for acc, n in (("heldout_accuracy_end", "heldout_n_end"), ("heldout_accuracy", "heldout_n")):
            if isinstance(r.get(acc), int | float):
                return float(r[acc]), int(r.get(n) or 0)
    return None


def paired_reward_gap(base: list[dict], run: list[dict]) -> tuple[float, float, int] | None:
    """run's reward minus base's, paired by step (both runs see the same prompts each step): the mean, its
    standard error over the steps and the number of steps; None for fewer than two."""
    rb = {r["step"]: r["reward_mean"] for r in base if isinstance(r.get("reward_mean"), int | float)}
    diffs = [r["reward_mean"] - rb[r["step"]] for r in run if r["step"] in rb and "reward_mean" in r]
    if len(diffs) < 2:
        return None
    d, se = mean_se(diffs)
    return d, se, len(diffs)


def agreement(base: list[dict], run: list[dict]) -> list[str]:
    """Whether `run` learned as `base` did, within the noise: reward paired by step (both runs see the same
    prompts each step), and the last held-out accuracy of each with its binomial standard error."""
    lines = []
    gap = paired_reward_gap(base, run)
    if gap is not None:
        d, se, n = gap
        outside = abs(d) > 2 * se
        lines.append(f"- reward, run - baseline, paired over {n} steps: {d:+.3f} ± {2 * se:.3f} "
                     f"(2 standard errors): {'OUTSIDE the noise' if outside else 'within noise'}")  # fmt: skip
        if outside:
            lines.append("  (the two runs learn from different answers, so their policies part from the first "
                         "update: one pair's gap is partly where each went; pairs over several seeds, "
                         "`benchmarks/e2e_rl.py --seeds`, judge it against the seeds' spread)")  # fmt: skip
    ha, hb = _last_heldout(base), _last_heldout(run)
    if ha and hb and ha[1] and hb[1]:
        sa, sb = (math.sqrt(p * (1 - p) / n) for p, n in (ha, hb))
        gap, noise = hb[0] - ha[0], 2 * math.hypot(sa, sb)
        verdict = "within noise" if abs(gap) <= noise else "OUTSIDE the noise"
        lines.append(f"- last held-out accuracy: baseline {ha[0]:.3f} (n={ha[1]}), run {hb[0]:.3f} (n={hb[1]}); "
                     f"gap {gap:+.3f} against ± {noise:.3f} (2 binomial standard errors): {verdict}")  # fmt: skip
    return lines


def drafter_curve_lines(runs: dict[str, list[dict]]) -> list[str]:
    """Per run with `logging.drafter_curve` records: the mean accept length of the online drafter, of the
    frozen starting drafter and the ceiling over the steps that logged all three, and online - frozen paired
    by step with two standard errors."""
    keys = ("drafter_accept_online", "drafter_accept_frozen", "accept_ceiling")
    lines = []
    for n, records in runs.items():
        rows = [r for r in records if all(isinstance(r.get(k), int | float) for k in keys)]
        if not rows:
            continue
        online, frozen, ceiling = (statistics.fmean(r[k] for r in rows) for k in keys)
        d, se = mean_se([r["drafter_accept_online"] - r["drafter_accept_frozen"] for r in rows])
        lines.append(f"- {n}, over {len(rows)} steps: online {online:.2f}, frozen {frozen:.2f}, ceiling "
                     f"{ceiling:.2f} tokens per step; online - frozen {d:+.2f} ± {2 * se:.2f}")  # fmt: skip
    return lines


def compile_lines(runs: dict[str, list[dict]], warmup: int = 1) -> list[str]:
    """Per run, the measured steps whose learner update compiled a graph (`learner_compiles`): a compile costs
    seconds once, so a short run's means carry it; each line gives those steps' learner seconds and the run's mean
    step time without them, the speedup over the first run's steps without theirs beside it."""
    names, out, kept = list(runs), [], {}
    for n, records in runs.items():
        rows = measured(records, warmup)
        slow = [r for r in rows if (r.get("learner_compiles") or 0) > 0]
        kept[n] = [r for r in rows if r not in slow]
        if not slow:
            continue
        steps = ", ".join(f"{r.get('step')} ({float(r.get('learner_seconds') or 0):.1f} s)" for r in slow)
        line = f"- {n}: updates that compiled a graph: step {steps}"
        times = values(kept[n], "step_seconds")
        base = values(kept.get(names[0], []), "step_seconds")
        if times and base:
            line += f"; without them a step takes {statistics.fmean(times):.2f} s"
            if n != names[0]:
                line += f", {statistics.fmean(base) / statistics.fmean(times):.2f}x of {names[0]}'s without its own"
        out.append(line)
    return out


def first_lengths(records: list[dict]) -> list[int]:
    return [n for r in records[:HIST_STEPS] for n in r.get("response_lengths", [])]
