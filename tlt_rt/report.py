"""`python -m tlt_rt.report RUN_DIR`: PNG plots and an HTML page for a training run.
`python -m tlt_rt.report RUN_A RUN_B ...`: the runs side by side (tlt_rt/compare/), RUN_A the baseline.

Reads RUN_DIR/metrics.jsonl and RUN_DIR/timelines.jsonl (written by `python -m tlt_rt.train`) and writes
RUN_DIR/report/{reward.png, accept.png, rollout.png, timeline.png, index.html}.
"""

from __future__ import annotations

import argparse
import html
import sys
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from tlt_rt.compare import write_compare  # noqa: E402
from tlt_rt.train.rl.metrics import read_jsonl  # noqa: E402
from tlt_rt.train.rl.sd_explain import sd_reason  # noqa: E402

COLORS = {"generating": "#4c72b0", "sd": "#55a868", "idle": "#d9d9d9", "drafter": "#dd8452"}
LABELS = {"generating": "generating", "sd": "speculative decoding", "idle": "idle", "drafter": "drafter training"}


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    # steps count from 1 in plots, as in the run's "step k/N" lines (metrics.jsonl counts from 0)
    pts = [(r["step"] + 1, r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


# each series its own colour, marker and dash, so that equal series (0/1 rewards make reward mean equal to
# accuracy) still read as two lines
STYLES = [
    dict(color="#4c72b0", marker="o", linestyle="-", markersize=5, linewidth=2.2),
    dict(color="#dd8452", marker="s", linestyle="--", markersize=7, linewidth=1.4, markerfacecolor="none"),
    dict(color="#55a868", marker="^", linestyle="-.", markersize=5, linewidth=1.4),
    dict(color="#8172b3", marker="x", linestyle=":", markersize=6, linewidth=1.4),
]
# the accept panel: what the rollout accepted, a perfect drafter's ceiling on the step's answers
# (logging.accept_ceiling) and, with logging.drafter_curve, the online drafter against a frozen copy of the
# run's starting drafter on the same answers
ACCEPT_SERIES = [
    ("accept_length", "rollout accept length"),
    ("accept_ceiling", "perfect-drafter ceiling (step's answers)"),
    ("drafter_accept_online", "online drafter (step's answers)"),
    ("drafter_accept_frozen", "frozen starting drafter (step's answers)"),
]


def _lines(ax, records: list[dict], keys: list[tuple[str, str]], ylabel: str, empty: str = "no data yet") -> None:
    for i, (key, label) in enumerate(keys):
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, label=label, **STYLES[i % len(STYLES)])
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, textwrap.fill(empty, 70), ha="center", va="center", transform=ax.transAxes, fontsize=8)


def _line_plot(records: list[dict], keys: list[tuple[str, str]], title: str, ylabel: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    _lines(ax, records, keys, ylabel)
    ax.set_title(title)
    ax.set_xlabel("RL step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reward(records: list[dict], path: Path) -> None:
    """Reward mean and accuracy; when rewards are 0/1 the two are equal, and the legend says so."""
    same = all(r.get("reward_mean") == r.get("accuracy") for r in records)
    acc_label = "accuracy (equals reward mean: rewards are 0/1)" if records and same else "accuracy"
    _line_plot(records, [("reward_mean", "reward mean"), ("accuracy", acc_label)], "reward", "value", path)


def plot_accept(records: list[dict], path: Path, unused: str | None) -> None:
    """Accept length (tokens per speculative step) and the drafter's top-1 agreement (a fraction) on two axes;
    steps without speculative steps are marked, and the last one's reason is printed under the plot."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 5.6), sharex=True)
    _lines(top, records, ACCEPT_SERIES, "tokens per SD step", empty="no speculative steps yet")
    gaps = [r["step"] + 1 for r in records if r.get("accept_length") is None]
    if gaps and top.lines:
        top.plot(gaps, [1.0] * len(gaps), "x", color="#999999", markersize=8, label="no speculative steps")
        top.legend(loc="best", fontsize=8)
    top.set_title("speculative decoding")
    _lines(bottom, records, [("drafter_top1", "drafter top-1 agreement with the target (training)")],
           "fraction", empty="no drafter training yet")  # fmt: skip
    if bottom.lines:
        bottom.set_ylim(0, 1)
    bottom.set_xlabel("RL step")
    fig.tight_layout()
    if unused:  # why the accept line stops (or never starts): the policy's numbers of the last step
        fig.subplots_adjust(bottom=0.2)
        fig.text(0.02, 0.015, textwrap.fill(f"Last step: {unused}", 110), fontsize=7, va="bottom", color="#444444")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(entry: dict | None, path: Path) -> None:
    """Gantt-like bars per worker: generating / SD / idle / drafter training (tail training on a thin lane)."""
    workers = sorted((entry or {}).get("workers", {}).items(), key=lambda kv: int(kv[0]))
    fig, ax = plt.subplots(figsize=(8.4, 1.4 + 0.6 * max(1, len(workers))))
    seen = set()
    for row, (_, bars) in enumerate(workers):
        gen_end = max((b for k, _, b in bars if k in ("generating", "sd")), default=0.0)
        for kind, start, end in bars:
            # drafter bars that overlap generation are tail training: draw them on a thin lane below
            tail = kind == "drafter" and start < gen_end
            y, h = (row - 0.38, 0.16) if tail else (row - 0.2, 0.4)
            label = None if kind in seen else LABELS.get(kind, kind)
            seen.add(kind)
            ax.broken_barh([(start, max(end - start, 1e-6))], (y, h), color=COLORS.get(kind, "#999"), label=label)
    ax.set_yticks(range(len(workers)), [f"worker {w}" for w, _ in workers])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from rollout start")
    step = (entry or {}).get("step")
    ax.set_title(f"worker timeline, step {step + 1}" if step is not None else "worker timeline (no data yet)")
    if seen:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _speculative(run_dir: Path) -> str:
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return str(cfg.get("rollout", {}).get("speculative", "auto"))
    except (OSError, yaml.YAMLError, AttributeError):
        return "auto"


def _unused_reason(records: list[dict], speculative: str) -> str | None:
    """Why the accept line stops or never starts (the last step without speculative steps), else None."""
    if not records or records[-1].get("accept_length") is not None:
        return None
    return sd_reason(records[-1], speculative)


def _fmt(key: str, v: Any, unused: str | None) -> str:
    if v is None:
        return (
            "- (no speculative steps in the last step: why is under Speculative decoding)"
            if key == "accept_length" and unused
            else "-"
        )
    if isinstance(v, float):
        return f"{v:.0%}" if key.endswith("_share") else f"{v:.4g}"
    return str(v)


def _summary_rows(records: list[dict], unused: str | None) -> list[tuple[str, str]]:
    if not records:
        return [("steps", "0")]
    last = records[-1]
    keys = ["reward_mean", "accuracy", "response_len_p50", "rollout_seconds", "tail_share", "sd_share",
            "accept_length", "accept_ceiling", "drafter_accept_online", "drafter_accept_frozen", "drafter_loss",
            "drafter_top1", "spot_steps", "harvested_worker_seconds",
            "learner_seconds", "tokens_per_second"]  # fmt: skip
    rows = [("steps", str(len(records)))]
    rows += [(k, _fmt(k, last.get(k), unused)) for k in keys]
    return rows


def write_report(run_dir: str | Path) -> Path:
    """Write the plots and index.html under RUN_DIR/report; returns the HTML path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder not found: {run_dir}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    timelines = read_jsonl(run_dir / "timelines.jsonl")
    speculative = _speculative(run_dir)
    unused = _unused_reason(records, speculative)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    plot_reward(records, out / "reward.png")
    plot_accept(records, out / "accept.png", unused)
    _line_plot(records, [("rollout_seconds", "rollout"), ("learner_seconds", "learner")], "time per step",
               "seconds", out / "rollout.png")  # fmt: skip
    plot_timeline(timelines[-1] if timelines else None, out / "timeline.png")
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(records, unused)
    )
    why = f"<p>{html.escape(sd_reason(records[-1], speculative))}</p>" if records else ""
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tlt_rt run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto}} td{{padding:2px 12px}}
img{{max-width:100%;border:1px solid #eee;margin:8px 0}}</style></head><body>
<h1>Run {html.escape(run_dir.name)}</h1>
<h2>Last step</h2><table>{rows}</table>
<h2>Reward and accuracy</h2><img src="reward.png" alt="reward and accuracy per step">
<h2>Speculative decoding</h2>{why}<img src="accept.png" alt="accept length and drafter agreement per step">
<h2>Time per step</h2><img src="rollout.png" alt="rollout and learner seconds per step">
<h2>Worker timeline (last step)</h2><img src="timeline.png" alt="per-worker timeline of the last step">
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt_rt.report", description=__doc__.splitlines()[0])
    ap.add_argument(
        "run_dirs",
        nargs="+",
        help="a run folder, e.g. runs/smollm2-arith; with two or more, a "
        "comparison page (the first is the baseline), as `python -m tlt_rt.compare` writes it",
    )
    ap.add_argument("--out", default=None, help="comparison only: its folder (default RUN_B/report/compare-RUN_A)")
    ap.add_argument("--warmup", type=int, default=1, help="comparison only: first steps left out of timing means")
    args = ap.parse_args(argv)
    try:
        if len(args.run_dirs) > 1:
            first, last = Path(args.run_dirs[0]), Path(args.run_dirs[-1])
            out = args.out or last / "report" / f"compare-{first.name}"
            path = write_compare(args.run_dirs, out, args.warmup)
            print(path.read_text())
        else:
            path = write_report(args.run_dirs[0])
    except (FileNotFoundError, ValueError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
