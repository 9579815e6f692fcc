"""`python -m tlt_rt.report RUN_DIR`: PNG plots and an HTML page for a training run.

Reads RUN_DIR/metrics.jsonl and RUN_DIR/timelines.jsonl (written by `python -m tlt_rt.train`) and writes
RUN_DIR/report/{reward.png, accept.png, rollout.png, timeline.png, index.html}.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from tlt_rt.train.metrics import read_jsonl  # noqa: E402

COLORS = {"generating": "#4c72b0", "sd": "#55a868", "idle": "#d9d9d9", "drafter": "#dd8452"}
LABELS = {"generating": "generating", "sd": "speculative decoding", "idle": "idle", "drafter": "drafter training"}


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _line_plot(records: list[dict], keys: list[tuple[str, str]], title: str, ylabel: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for key, label in keys:
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
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
    ax.set_title(f"worker timeline, step {step}" if step is not None else "worker timeline (no data yet)")
    if seen:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary_rows(records: list[dict]) -> list[tuple[str, str]]:
    if not records:
        return [("steps", "0")]
    last = records[-1]
    keys = ["reward_mean", "accuracy", "response_len_p50", "rollout_seconds", "tail_share", "sd_share",
            "accept_length", "drafter_loss", "spot_steps", "harvested_worker_seconds", "learner_seconds",
            "tokens_per_second"]  # fmt: skip
    rows = [("steps", str(len(records)))]
    for k in keys:
        v = last.get(k)
        rows.append((k, f"{v:.4g}" if isinstance(v, float) else str(v)))
    return rows


def write_report(run_dir: str | Path) -> Path:
    """Write the plots and index.html under RUN_DIR/report; returns the HTML path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder not found: {run_dir}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    timelines = read_jsonl(run_dir / "timelines.jsonl")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    _line_plot(records, [("reward_mean", "reward mean"), ("accuracy", "accuracy")], "reward", "value",
               out / "reward.png")  # fmt: skip
    accept = [("accept_length", "rollout accept length"), ("drafter_top1", "drafter top-1 agreement (train)")]
    _line_plot(records, accept, "speculative decoding", "accept length / agreement", out / "accept.png")
    _line_plot(records, [("rollout_seconds", "rollout"), ("learner_seconds", "learner")], "time per step",
               "seconds", out / "rollout.png")  # fmt: skip
    plot_timeline(timelines[-1] if timelines else None, out / "timeline.png")
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(records))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tlt_rt run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto}} td{{padding:2px 12px}}
img{{max-width:100%;border:1px solid #eee;margin:8px 0}}</style></head><body>
<h1>Run {html.escape(run_dir.name)}</h1>
<h2>Last step</h2><table>{rows}</table>
<h2>Reward and accuracy</h2><img src="reward.png" alt="reward and accuracy per step">
<h2>Speculative decoding</h2><img src="accept.png" alt="accept length per step">
<h2>Time per step</h2><img src="rollout.png" alt="rollout and learner seconds per step">
<h2>Worker timeline (last step)</h2><img src="timeline.png" alt="per-worker timeline of the last step">
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt_rt.report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run folder, e.g. runs/smollm2-arith")
    args = ap.parse_args(argv)
    try:
        path = write_report(args.run_dir)
    except FileNotFoundError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
