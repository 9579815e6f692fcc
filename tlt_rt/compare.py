"""`python -m tlt_rt.compare RUN_DIR [RUN_DIR ...] --out DIR`: runs side by side.

For runs of the same config and seed that differ in one setting (typically SD auto + spot drafter training
against SD off), writes DIR/compare.md and DIR/compare.png so that a speedup and "the learning is unchanged"
read from one page:
- per run, the means of the step-time breakdown over the steps after `--warmup` (they carry start-up work:
  first captures, first compiles), and the speedup over the first run with its standard error;
- whether the learning agrees: per-step reward differences paired by step (same prompts), and the held-out
  accuracy with its binomial standard error;
- where the rollout's time goes per batch size (power-of-two buckets): seconds, tokens per second, SD share
  and accept length beside the perfect-drafter ceiling;
- the speedup at equal work: each run's tokens/s per batch size applied to the first run's tokens per batch
  size, so that the luck of how long the sampled tails ran drops out of the comparison;
- plain decoding steps' time per batch size by their place after a prefill or speculative step (what the SD
  policy prices plain decoding from, against plain steps once settled);
- the response-length histogram of the first steps (the tail the rollout waits for);
- with `logging.drafter_curve`, the online drafter's accept length against the frozen starting drafter's and
  the ceiling, on each step's answers (plotted beside the accept length).
`python -m tlt_rt.report RUN_A RUN_B` writes the same page.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from tlt_rt.train.rl.metrics import percentile, read_jsonl

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


def _values(records: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), int | float)]


def run_means(records: list[dict], warmup: int = 1) -> dict[str, float | None]:
    """Mean of each column over the run's measured steps."""
    rows = measured(records, warmup)
    out: dict[str, float | None] = {}
    for key, _, _ in COLUMNS:
        vals = _values(rows, key)
        out[key] = statistics.fmean(vals) if vals else None
    return out


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (0 for fewer than two values)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def speedup(base: list[dict], run: list[dict], warmup: int = 1) -> tuple[float, float] | None:
    """Mean base step time over mean run step time, and its standard error (delta method over the two
    means' standard errors); None without step times."""
    a, b = _values(measured(base, warmup), "step_seconds"), _values(measured(run, warmup), "step_seconds")
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


def agreement(base: list[dict], run: list[dict]) -> list[str]:
    """Whether `run` learned as `base` did, within the noise: reward paired by step (both runs see the same
    prompts each step), and the last held-out accuracy of each with its binomial standard error."""
    lines = []
    rb = {r["step"]: r["reward_mean"] for r in base if isinstance(r.get("reward_mean"), int | float)}
    diffs = [r["reward_mean"] - rb[r["step"]] for r in run if r["step"] in rb and "reward_mean" in r]
    if len(diffs) > 1:
        d, se = mean_se(diffs)
        verdict = "within noise" if abs(d) <= 2 * se else "OUTSIDE the noise"
        lines.append(f"- reward, run - baseline, paired over {len(diffs)} steps: {d:+.3f} ± {2 * se:.3f} "
                     f"(2 standard errors): {verdict}")  # fmt: skip
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


def buckets(records: list[dict]) -> dict[int, dict[str, float]]:
    """Per batch bucket, the run's decode and SD seconds and tokens summed over `records`."""
    out: dict[int, dict[str, float]] = {}
    for r in records:
        for b, row in (r.get("batch_buckets") or {}).items():
            acc = out.setdefault(int(b), {})
            for k, v in row.items():
                acc[k] = acc.get(k, 0.0) + v
    return dict(sorted(out.items()))


def _totals(row: dict[str, float]) -> tuple[float, float]:
    """A bucket row's (seconds, tokens), plain and speculative steps together."""
    return row["decode_s"] + row["sd_s"], row["decode_tokens"] + row["sd_tokens"]


def bucket_table(runs: dict[str, list[dict]], warmup: int = 1) -> list[str]:
    """Where the rollout's time goes per batch size: each run's seconds and tokens per second per bucket, SD
    share and accept length where it speculated, and the bucket's speedup over the first run (tok/s ratio)."""
    per = {n: buckets(measured(r, warmup)) for n, r in runs.items()}
    all_b = sorted({b for p in per.values() for b in p})
    if not all_b:
        return []
    names = list(runs)
    head = "| batch | " + " | ".join(f"{n} s | {n} tok/s | {n} SD | {n} accept" for n in names) + " |"
    md = [head, "|---:|" + "---:|---:|---:|---:|" * len(names)]
    for b in all_b:
        cells = []
        for n in names:
            row = per[n].get(b)
            if not row:
                cells += ["-"] * 4
                continue
            secs, toks = _totals(row)
            rate, share = (f"{toks / secs:.0f}", f"{row['sd_s'] / secs:.0%}") if secs else ("-", "-")
            accept = f"{row['sd_tokens'] / row['sd_rows']:.2f}" if row["sd_rows"] else "-"
            cells += [f"{secs:.1f}", rate, share, accept]
        md.append(f"| {b} | " + " | ".join(cells) + " |")
    return md


def _rate_time(rows: dict[str, dict] | dict[int, dict], rates: dict[int, float]) -> tuple[float, float]:
    """(decode seconds spent, seconds at `rates`) over the buckets of `rows` (a bucket without a rate keeps
    its own time)."""
    spent = at = 0.0
    for b, row in rows.items():
        secs, toks = _totals(row)
        spent += secs
        rate = rates.get(int(b))
        at += toks / rate if rate else secs
    return spent, at


def _saved(rows: dict, rates: dict[int, float]) -> float:
    spent, at = _rate_time(rows, rates)
    return spent - at


def equal_work(base: list[dict], run: list[dict], warmup: int = 1) -> dict | None:
    """The run's speed on the baseline's work: sampled answers differ between runs, and a run whose tail
    happened to be long waits more at batch 1, so the two step times also differ by luck. Here the baseline's
    decode tokens of each batch bucket are timed at the run's own tokens/s in that bucket (the baseline's where
    the run has no such bucket), and the decode time saved comes off each baseline step: per worker where the
    records have each worker's buckets (the step then waits for the worker that is last after the saving),
    else spread evenly over the workers. Prefill and the rest of the step stay the baseline's. Returns the
    rollout decode speed ratio, the estimated step seconds and the speedup; None without bucket records."""
    b_rows, r_rows = measured(base, warmup), measured(run, warmup)
    pb = buckets(b_rows)
    steps = _values(b_rows, "step_seconds")
    if not pb or not steps or len(steps) != len(b_rows):
        return None
    rates = {}
    for b, row in buckets(r_rows).items():
        secs, toks = _totals(row)
        if secs > 0 and toks > 0:
            rates[b] = toks / secs
    spent, at_run = _rate_time(pb, rates)
    if spent <= 0 or at_run <= 0:
        return None
    estimated = []
    for r in b_rows:
        ends, per = r.get("worker_rollout_seconds") or [], r.get("batch_buckets_by_worker")
        if per and len(per) == len(ends):
            after = [end - _saved(rows, rates) for end, rows in zip(ends, per, strict=True)]
            estimated.append(r["step_seconds"] - (max(ends) - max(after)))
        else:
            estimated.append(r["step_seconds"] - _saved(r.get("batch_buckets") or {}, rates) / max(len(ends), 1))
    step = statistics.fmean(estimated)
    return {"decode_ratio": spent / at_run, "step_seconds": step, "speedup": statistics.fmean(steps) / step}


def equal_work_lines(runs: dict[str, list[dict]], warmup: int = 1) -> list[str]:
    names = list(runs)
    out = []
    for n in names[1:]:
        est = equal_work(runs[names[0]], runs[n], warmup)
        if est is not None:
            out.append(f"- {n}: decodes {names[0]}'s tokens {est['decode_ratio']:.2f}x as fast (per batch size, "
                       f"at its own tokens/s); with {names[0]}'s prefill and other step time, a step of "
                       f"{est['step_seconds']:.2f} s: **{est['speedup']:.2f}x** at equal work")  # fmt: skip
    return out


def plain_step_table(runs: dict[str, list[dict]], warmup: int = 1) -> list[str]:
    """Plain decoding steps' time per batch bucket, by place after a prefill or SD step (1, 2, 3+): each
    step's median, averaged over the measured steps weighted by their counts (`plain_step_ms` records)."""
    per: dict[str, dict[int, dict[str, list[float]]]] = {}
    for n, records in runs.items():
        acc = per.setdefault(n, {})
        for r in measured(records, warmup):
            for b, places in (r.get("plain_step_ms") or {}).items():
                for place, (count, ms) in places.items():
                    cell = acc.setdefault(int(b), {}).setdefault(place, [0.0, 0.0])
                    cell[0] += count
                    cell[1] += count * ms
    all_b = sorted({b for acc in per.values() for b in acc})
    if not all_b:
        return []
    names = list(runs)
    md = ["| batch | " + " | ".join(f"{n} ms (1 / 2 / 3+)" for n in names) + " |", "|---:|" + "---:|" * len(names)]
    for b in all_b:
        cells = []
        for n in names:
            row = per[n].get(b, {})
            cells.append(" / ".join(f"{row[k][1] / row[k][0]:.2f}" if k in row and row[k][0] else "-"
                                    for k in ("1", "2", "3+")))  # fmt: skip
        md.append(f"| {b} | " + " | ".join(cells) + " |")
    return md


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
        times = _values(kept[n], "step_seconds")
        base = _values(kept.get(names[0], []), "step_seconds")
        if times and base:
            line += f"; without them a step takes {statistics.fmean(times):.2f} s"
            if n != names[0]:
                line += f", {statistics.fmean(base) / statistics.fmean(times):.2f}x of {names[0]}'s without its own"
        out.append(line)
    return out


def first_lengths(records: list[dict]) -> list[int]:
    return [n for r in records[:HIST_STEPS] for n in r.get("response_lengths", [])]


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_compare(runs: dict[str, list[dict]], path: Path, warmup: int = 1) -> None:
    # local: matplotlib is slow to import and its backend must be chosen before pyplot; only a plot needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13.5, 7.2))
    series = (("reward_mean", "reward mean per step"), ("heldout_accuracy", "held-out accuracy"),
              ("step_seconds", "step seconds"))  # fmt: skip
    for ax, (key, title) in zip(axes[0], series, strict=True):
        for n, records in runs.items():
            pts = [(r["step"] + 1, r[key]) for r in records if isinstance(r.get(key), int | float)]
            if key == "heldout_accuracy" and isinstance(records[-1].get("heldout_accuracy_end"), int | float):
                pts.append((records[-1]["step"] + 2, records[-1]["heldout_accuracy_end"]))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, label=n)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("RL step")
        _legend(ax)
    ax = axes[1][0]
    for i, (n, records) in enumerate(runs.items()):
        color = f"C{i}"  # each run keeps its colour from the other panels
        for key, style, label in (("accept_length", "o-", "accept"), ("accept_ceiling", "--", "ceiling"),
                                  ("drafter_accept_online", "s-.", "online drafter"),
                                  ("drafter_accept_frozen", "x:", "frozen drafter")):  # fmt: skip
            # drafter_accept_*: logging.drafter_curve, the online and the frozen starting drafter on the answers
            pts = [(r["step"] + 1, r[key]) for r in records if isinstance(r.get(key), int | float)]
            if pts:
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                ax.plot(xs, ys, style, markersize=3, color=color, label=f"{n} {label}")
    ax.set_title("accept length, drafters and perfect-drafter ceiling", fontsize=9)
    ax.set_xlabel("RL step")
    _legend(ax)
    ax = axes[1][1]
    per = {n: buckets(measured(r, warmup)) for n, r in runs.items()}
    all_b = sorted({b for p in per.values() for b in p})
    width = 0.8 / max(len(runs), 1)
    for i, (n, rows) in enumerate(per.items()):
        secs = [_totals(rows[b])[0] if b in rows else 0.0 for b in all_b]
        ax.bar([x + i * width for x in range(len(all_b))], secs, width, label=n)
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(all_b))], [str(b) for b in all_b])
    ax.set_title("rollout seconds per batch size (measured steps)", fontsize=9)
    ax.set_xlabel("running sequences (bucket)")
    _legend(ax)
    ax = axes[1][2]
    for n, records in runs.items():
        lengths = first_lengths(records)
        if lengths:
            ax.hist(lengths, bins=40, alpha=0.5, label=n)
    ax.set_title(f"response lengths, first {HIST_STEPS} steps", fontsize=9)
    ax.set_xlabel("tokens")
    ax.set_yscale("log")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_compare(run_dirs: list[str | Path], out: str | Path, warmup: int = 1) -> Path:
    if len(run_dirs) < 2:
        raise ValueError("compare needs at least two run folders")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    runs = {Path(d).name: load_run(d) for d in run_dirs}
    if len(runs) != len(run_dirs):
        raise ValueError("run folders must have distinct names")
    # a run cut short (a time limit) is compared on the steps all runs have: later steps have other answers
    common = min(len(r) for r in runs.values())
    cut = [n for n, r in runs.items() if len(r) > common]
    runs = {n: r[:common] for n, r in runs.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_compare(runs, out / "compare.png", warmup)
    names = list(runs)
    md = [f"Means over the steps after the first {warmup} (all steps when a run has no more); speedup = "
          f"{names[0]}'s mean step time / the run's, ± one standard error.", ""]  # fmt: skip
    if cut:
        md += [f"Only the first {common} steps are compared: {', '.join(cut)} ran more.", ""]
    md += compare_table(runs, warmup) + [""]
    for n in names[1:]:
        lines = agreement(runs[names[0]], runs[n])
        if lines:
            md += [f"Learning, {n} against {names[0]}:", "", *lines, ""]
    curve = drafter_curve_lines(runs)
    if curve:
        md += ["Drafter accept length on each step's answers, the online drafter against a frozen copy of the run's "
               "starting drafter (the ceiling's measure, a perfect drafter's):", "", *curve, ""]  # fmt: skip
    same = equal_work_lines(runs, warmup)
    if same:
        md += ["At equal work (each run's tokens/s per batch size applied to the first run's tokens per batch size, "
               "so that how long the sampled tails happened to be drops out):", "", *same, ""]  # fmt: skip
    slow = compile_lines(runs, warmup)
    if slow:
        md += ["Compiles inside the measured updates (each costs seconds once; the start-up warm-up is meant to leave "
               "none):", "", *slow, ""]  # fmt: skip
    table = bucket_table(runs, warmup)
    if table:
        md += ["Rollout time per batch size (running sequences, power-of-two buckets; measured steps):", "", *table, ""]
    table = plain_step_table(runs, warmup)
    if table:
        md += ["Plain steps by batch size and place after a prefill or speculative step (the SD policy prices plain "
               "decoding from the 3rd on, rollout.policy.plain_settle; median ms a step):", "", *table, ""]  # fmt: skip
    for n, records in runs.items():
        lengths = first_lengths(records)
        if lengths:
            p50, p99 = percentile(lengths, 50), percentile(lengths, 99)
            md.append(f"- {n}: response lengths of the first {min(HIST_STEPS, len(records))} steps: p50 {p50:.0f}, "
                      f"p99 {p99:.0f} ({p99 / max(p50, 1):.1f}x the median), max {max(lengths)}")  # fmt: skip
    md += ["", "![compare](compare.png)", ""]
    path = out / "compare.md"
    path.write_text("\n".join(md))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt_rt.compare", description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="run folders; the first is the baseline")
    ap.add_argument("--out", required=True, help="folder for compare.md and compare.png")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the timing means (default 1)")
    args = ap.parse_args(argv)
    try:
        path = write_compare(args.run_dirs, args.out, args.warmup)
    except (FileNotFoundError, ValueError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
