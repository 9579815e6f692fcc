"""Plot `bench_attention.py --tree-splits` logs: tree attention with every split's partials written and merged
against the used splits' only, one panel per log (model heads), a pair of bars per (case, block table).

    python benchmarks/plot_tree_splits.py OUT.png LOG [LOG ...]

Each log's markdown table (batch, context, tree tokens, table positions, splits, both times in ms, their ratio) is
read as the benchmark printed it; its `# attention heads of NAME` line names the panel.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = ("batch", "context", "tree", "table", "splits", "every", "used")


def read_log(path: str) -> tuple[str, list[dict]]:
    """(panel title, rows) of one log; a ValueError names a log without the benchmark's table."""
    text = Path(path).read_text()
    heads = re.search(r"^# attention heads of ([^\s:]+)", text, re.MULTILINE)
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0].isdigit():
            rows.append(dict(zip(COLUMNS, [int(c) for c in cells[:5]] + [float(c) for c in cells[5:7]], strict=True)))
    if not rows:
        raise ValueError(f"{path}: no `bench_attention.py --tree-splits` table in it")
    return (heads.group(1) if heads else Path(path).stem), rows


def plot(logs: list[str], out: str) -> None:
    panels = [read_log(p) for p in logs]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.6), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels, strict=True):
        x = range(len(rows))
        every = [1e3 * r["every"] for r in rows]
        used = [1e3 * r["used"] for r in rows]
        ax.bar([i - 0.2 for i in x], every, 0.4, label="every split written and merged", color="#bbbbbb")
        ax.bar([i + 0.2 for i in x], used, 0.4, label="the used splits only", color="#3b75af")
        for i, (e, u) in enumerate(zip(every, used, strict=True)):
            ax.annotate(f"{e / u:.2f}x", (i + 0.2, u), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x))
        labels = [f"b{r['batch']}, {r['context']}\nT={r['tree']}\n{r['table'] / 1024:.1f}K tab\n{r['splits']} splits"
                  for r in rows]  # fmt: skip
        ax.set_xticklabels(labels, fontsize=6.5)
        ax.set_xlabel("batch, context; tree tokens; block table (positions); splits", fontsize=8)
        ax.set_ylabel("us a call (CUDA-graph replays, median)")
        ax.set_title(f"tree attention, {title} heads", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("logs", nargs="+")
    args = ap.parse_args(argv)
    plot(args.logs, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
