"""The comparison page's figure: reward, held-out accuracy and step time per step; accept length beside the
drafters and the ceiling; rollout seconds per batch size; the response-length histogram."""

from __future__ import annotations

from pathlib import Path

from tlt_rt.compare.batches import _totals, buckets
from tlt_rt.compare.records import HIST_STEPS, first_lengths, measured


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
