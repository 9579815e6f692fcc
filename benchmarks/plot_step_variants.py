"""Plot `step_costs.py --compare` records: each variant's decode step against the model's HBM floor, one panel per
model, bars labelled with their share of the floor and their speedup over the first variant.

    python benchmarks/plot_step_variants.py OUT.png RECORDS.jsonl [RECORDS.jsonl ...] [--batch 1] [--title T]

Rows are taken at one batch size, one-token (decode) steps; where a (model, variant) appears more than once (records
of several runs), its last row counts. Variants that computed the same step (equal logits hashes) share a hatch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(paths: list[str], batch: int) -> dict[str, list[dict]]:
    """{model: its variants' rows in first-seen order} of the decode rows at `batch`; an error where none is."""
    by_model: dict[str, dict[str, dict]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if "label" not in row or row.get("tokens", 1) != 1 or row.get("batch") != batch:
                continue
            by_model.setdefault(row["model"], {})[row["label"]] = row
    if not by_model:
        raise SystemExit(f"plot_step_variants: no `--compare` decode rows at batch {batch} in {', '.join(paths)}")
    return {model: list(rows.values()) for model, rows in by_model.items()}


def plot(by_model: dict[str, list[dict]], out: str, title: str = "") -> None:
    height = 0.55 * max(map(len, by_model.values())) + 1.8
    fig, axes = plt.subplots(1, len(by_model), figsize=(5.2 * len(by_model), height), squeeze=False)
    for ax, (model, rows) in zip(axes[0], by_model.items(), strict=True):
        labels = [r["label"] for r in rows]
        ms = [r["ms"] for r in rows]
        first = rows[0]["ms"]
        digests = [r.get("logits_digest") for r in rows]
        shared = {d for d in digests if d and digests.count(d) > 1}
        bars = ax.barh(range(len(rows)), ms, color="#4c72b0")
        for bar, d in zip(bars, digests, strict=True):
            if d in shared:
                bar.set_hatch("//")
        floor = rows[0]["floor_ms"]
        ax.axvline(floor, color="#c44e52", ls="--", lw=1.2, label=f"HBM floor {floor:.3f} ms")
        for i, r in enumerate(rows):
            ax.text(r["ms"], i, f" {r['ms']:.3f} ms, {100 * floor / r['ms']:.0f}% of floor, {first / r['ms']:.2f}x",
                    va="center", fontsize=8)  # fmt: skip
        ax.set_yticks(range(len(rows)), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, max(ms) * 1.9)
        ax.set_xlabel("decode step, ms (CUDA graph replay)")
        ax.set_title(f"{model}, batch {rows[0]['batch']}, ctx {rows[0]['ctx']}", fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(title or "decode step by kernel variant (hatched: the same logits)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("records", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    plot(load(args.records, args.batch), args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
