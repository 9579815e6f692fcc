"""Plot `engine_throughput.py --out` files: tokens/s against batch per config, and auto / off per batch.

    python benchmarks/plot_engine.py OUT.png RUN.jsonl [RUN.jsonl ...] [--labels A B ...]

Each file is one run (one device, one commit); the right panel puts the runs side by side, which is where
the adaptive policy's cost against plain decoding shows. A run timed with `--interleave` carries each
configuration's ratio to off paired by round (the median of the rounds' ratios, what the result tables
report); the panel takes it where present, else the ratio of the median tokens/s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path: str) -> dict[str, dict[int, float]]:
    """config -> batch -> tokens/s of the engine rows of one run."""
    rows: dict[str, dict[int, float]] = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r.get("provider", "tlt") == "tlt":
            rows.setdefault(r["config"], {})[int(r["batch"])] = float(r["tokens_per_s"])
    if "off" not in rows:
        raise ValueError(f"{path}: no 'off' rows to compare against")
    return rows


def paired_ratios(path: str) -> dict[str, dict[int, float]]:
    """config -> batch -> the ratio to off paired by round, for the rows of an interleaved run that have it."""
    out: dict[str, dict[int, float]] = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r.get("provider", "tlt") == "tlt" and r.get("paired_ratio") is not None:
            out.setdefault(r["config"], {})[int(r["batch"])] = float(r["paired_ratio"])
    return out


def auto_ratio(rows: dict[str, dict[int, float]], paired: dict[str, dict[int, float]], batch: int) -> float:
    """auto / off at `batch`: the paired ratio where the run has one, else the medians' ratio (nan: not run)."""
    nan = float("nan")
    if batch in paired.get("auto", {}):
        return paired["auto"][batch]
    return rows.get("auto", {}).get(batch, nan) / rows["off"].get(batch, nan)


def plot(out: str, runs: list[str], labels: list[str]) -> None:
    data = [load(p) for p in runs]
    paired = [paired_ratios(p) for p in runs]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (label, rows), style in zip(zip(labels, data, strict=True), ["-", "--", ":", "-."] * 4, strict=False):
        for config, by_batch in sorted(rows.items()):
            xs = sorted(by_batch)
            ax.plot(xs, [by_batch[x] for x in xs], style, marker="o", label=f"{config} ({label})")
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="engine throughput")
    ax.legend(fontsize=7)
    width = 0.8 / len(data)
    batches = sorted({b for rows in data for b in rows["off"]})
    for i, (label, rows, pr) in enumerate(zip(labels, data, paired, strict=True)):
        ratio = [auto_ratio(rows, pr, b) for b in batches]
        ax2.bar([j + i * width for j in range(len(batches))], ratio, width, label=label)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(0.97, color="r", lw=0.8, ls="--", label="3% below off")
    ax2.set_xticks([j + width * (len(data) - 1) / 2 for j in range(len(batches))], [str(b) for b in batches])
    ax2.set(xlabel="batch", ylabel="auto / off tokens/s", title="adaptive policy against plain decoding")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--labels", nargs="+", default=None)
    args = ap.parse_args(argv)
    labels = args.labels or [Path(p).stem for p in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"{len(args.runs)} runs but {len(labels)} labels")
    plot(args.out, args.runs, labels)


if __name__ == "__main__":
    main()
