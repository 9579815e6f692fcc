"""`python -m tlt_rt.compare RUN_DIR [RUN_DIR ...] --out DIR`: runs side by side.

For runs of the same config and seed that differ in one setting (typically SD auto + spot drafter training
against SD off), writes DIR/compare.md (per-run means of the step-time breakdown, speedup over the first
run) and DIR/compare.png (reward, step time and rollout time per step, one line per run), so a speedup
and "the learning is unchanged" can be read from one page. Step 0 is left out of the means when a run has
more than one step (it carries start-up work: first captures, first compiles).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tlt_rt.train.rl.metrics import read_jsonl

# (metrics key, column heading, format)
COLUMNS = (
    ("step_seconds", "step s", ".2f"),
    ("rollout_seconds", "rollout s", ".2f"),
    ("tail_share", "tail share", ".0%"),
    ("learner_seconds", "learner s", ".2f"),
    ("sd_share", "SD share", ".0%"),
    ("accept_length", "accept", ".2f"),
    ("spot_steps", "spot steps", ".1f"),
    ("harvested_worker_seconds", "harvested s", ".1f"),
    ("tokens_per_second", "tok/s", ".0f"),
    ("reward_mean", "reward", ".3f"),
)


def load_run(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    records = read_jsonl(path)
    if not records:
        raise ValueError(f"{path} has no steps")
    return records


def run_means(records: list[dict]) -> dict[str, float | None]:
    """Mean of each column over the run's steps (step 0 dropped when there are others)."""
    rows = records[1:] if len(records) > 1 else records
    out: dict[str, float | None] = {}
    for key, _, _ in COLUMNS:
        vals = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
        out[key] = statistics.fmean(vals) if vals else None
    return out


def compare_table(runs: dict[str, list[dict]]) -> list[str]:
    names = list(runs)
    means = {n: run_means(runs[n]) for n in names}
    base = means[names[0]]["step_seconds"]
    head = "| run | steps | " + " | ".join(h for _, h, _ in COLUMNS) + " | speedup |"
    md = [head, "|---|---:|" + "---:|" * (len(COLUMNS) + 1)]
    for n in names:
        m = means[n]
        cells = [("-" if m[k] is None else format(m[k], f)) for k, _, f in COLUMNS]
        speed = "-" if not (base and m["step_seconds"]) else f"{base / m['step_seconds']:.2f}x"
        md.append(f"| {n} | {len(runs[n])} | " + " | ".join(cells) + f" | {speed} |")
    return md


def plot_compare(runs: dict[str, list[dict]], path: Path) -> None:
    # local: matplotlib is slow to import and its backend must be chosen before pyplot; only a plot needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("reward_mean", "reward mean"), ("step_seconds", "step seconds"), ("rollout_seconds", "rollout seconds"))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4))
    for ax, (key, label) in zip(axes, keys, strict=True):
        for n, records in runs.items():
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, label=n)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_compare(run_dirs: list[str | Path], out: str | Path) -> Path:
    if len(run_dirs) < 2:
        raise ValueError("compare needs at least two run folders")
    runs = {Path(d).name: load_run(d) for d in run_dirs}
    if len(runs) != len(run_dirs):
        raise ValueError("run folders must have distinct names")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_compare(runs, out / "compare.png")
    md = [f"Means over steps (step 0 left out when a run has more); speedup = {next(iter(runs))} step s / run's.", ""]
    md += compare_table(runs) + ["", "![compare](compare.png)", ""]
    path = out / "compare.md"
    path.write_text("\n".join(md))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt_rt.compare", description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="run folders; the first is the baseline")
    ap.add_argument("--out", required=True, help="folder for compare.md and compare.png")
    args = ap.parse_args(argv)
    try:
        path = write_compare(args.run_dirs, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
