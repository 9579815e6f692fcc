"""Plot `drafter_rl.py` results: each drafter's accept length beside the perfect-drafter ceiling on its answers.

    python benchmarks/plot_drafter_rl.py OUT.png RUN.jsonl|RUN.log [...]

Reads the JSON rows of each file (a drafter_rl `--out` file, or its log, whose JSON lines are the rows) in
order; one bar group per (variant, strategy), one panel per temperature, the ratio written above each
bar and a tick at 75% of each ceiling. A (variant, strategy, temperature) that several files measured is
shown once per measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NEEDED = ("variant", "strategy", "temperature", "accept_length", "ceiling")
AIM = 0.75  # the share of the ceiling a drafter is held to at the RL temperature


def load(paths: list[str]) -> list[dict]:
    """The rows of every file, in order; a file without any drafter_rl row is an error."""
    rows = []
    for path in paths:
        found = 0
        for line in Path(path).read_text().splitlines():
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if all(k in r for k in NEEDED):
                rows.append(r)
                found += 1
        if not found:
            raise ValueError(f"{path}: no drafter_rl rows (JSON lines with {', '.join(NEEDED)})")
    return rows


def plot(out: str, rows: list[dict]) -> None:
    temps = sorted({float(r["temperature"]) for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps, strict=True):
        group = [r for r in rows if float(r["temperature"]) == temp]
        labels, seen = [], {}
        for r in group:
            key = f"{r['variant']}\n{r['strategy']}"
            seen[key] = seen.get(key, 0) + 1
            labels.append(key if seen[key] == 1 else f"{key} ({seen[key]})")
        xs = range(len(group))
        ceil = [float(r["ceiling"]) for r in group]
        acc = [float(r["accept_length"]) for r in group]
        ax.bar(xs, ceil, width=0.7, color="none", edgecolor="tab:gray", hatch="//", label="perfect drafter")
        ax.bar(xs, acc, width=0.5, color="tab:blue", label="drafter")
        ax.scatter(xs, [AIM * c for c in ceil], marker="_", s=400, color="black", zorder=3,
                   label=f"{AIM:.0%} of the ceiling")  # fmt: skip
        for x, a, c in zip(xs, acc, ceil, strict=True):
            ax.text(x, c, f"{a / c:.0%}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), labels, fontsize=7)
        name = "greedy" if temp == 0 else f"T={temp:g}"
        ax.set(ylabel="tokens per step", title=f"accept length, {name}", ylim=(0, 1.2 * max(ceil)))
        ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args(argv)
    plot(a.out, load(a.runs))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
