"""Plot drafter warm-ups side by side: accept / ceiling along each warm-up, against the tokens trained on and
against the seconds spent generating and training (the warm-up's budget), from their `warmup.json` reports.

    python benchmarks/plot_warmups.py OUT.png WARMUP.json [WARMUP.json ...] [--labels A B ...] [--title T]

Each report needs a curve (`--curve N`, N >= 2, at warm-up time); a point's ratio is the drafter's accept length
over the perfect-drafter ceiling of the same tree on the same held-out answers. The second panel shows which
recipe reaches a ratio first within a time budget (generation + training, the curve's own measures left out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path: str) -> tuple[dict, list[dict]]:
    """The report and its curve; an error naming the file where it has none."""
    rep = json.loads(Path(path).read_text())
    curve = rep.get("curve") or []
    if len(curve) < 2:
        raise SystemExit(f"plot_warmups: {path} has no curve (warm it up with --curve 2 or more)")
    for point in curve:
        if not point.get("ceiling"):
            raise SystemExit(f"plot_warmups: {path} has a curve point without a ceiling: {point}")
    return rep, curve


def label_of(rep: dict) -> str:
    """A default label: prompts, passes over them and unrolled passes."""
    return f"{rep.get('train_prompts')} prompts, unroll {rep.get('unroll')}"


def plot(reports: list[tuple[dict, list[dict]]], labels: list[str], out: Path, title: str) -> Path:
    fig, (by_tokens, by_seconds) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for (rep, curve), label in zip(reports, labels, strict=True):
        ratio = [c["accept"] / c["ceiling"] for c in curve]
        final = rep.get("accept_by_strategy", {}).get(rep.get("strategy"), {})
        tag = f"{label} ({final['ratio']:.0%})" if final.get("ratio") else label
        by_tokens.plot([c["train_tokens"] / 1e6 for c in curve], ratio, "o-", label=tag)
        by_seconds.plot([c["seconds"] for c in curve], ratio, "o-", label=tag)
    by_tokens.set_xlabel("training tokens seen (millions)")
    by_seconds.set_xlabel("seconds of generation + training")
    by_tokens.set_ylabel("drafter accept / perfect-drafter ceiling")
    for ax in (by_tokens, by_seconds):
        ax.grid(alpha=0.3)
        ax.axhline(0.75, color="grey", lw=0.8, ls=":")
    by_seconds.axvline(300, color="grey", lw=0.8, ls=":")
    by_tokens.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the PNG to write")
    ap.add_argument("reports", nargs="+", help="warmup.json files")
    ap.add_argument("--labels", nargs="*", default=None, help="one per report (default: prompts and unroll)")
    ap.add_argument("--title", default="drafter warm-ups: accept against the ceiling")
    a = ap.parse_args(argv)
    reports = [load(p) for p in a.reports]
    labels = a.labels or [label_of(rep) for rep, _ in reports]
    if len(labels) != len(reports):
        ap.error(f"--labels: {len(labels)} labels for {len(reports)} reports")
    print(plot(reports, labels, Path(a.out), a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
