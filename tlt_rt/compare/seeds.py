"""The comparison over several seeds: one (baseline, run) pair per seed, read together.

Within one pair the per-step reward differences are paired by prompt, but from the first update on the two
policies have learned from different samples and part ways; a gap between two such runs can come from where
each run's policy happened to go, which the steps of one pair cannot tell from a difference in how they sample.
Each seed's mean gap is one independent draw of that: across seeds their spread is the noise a learning
comparison has to beat. The same holds for the speedup, whose per-seed value also carries the luck of each
seed's tails.

    python -m tlt_rt.compare.seeds OUT/runs --out OUT    # pairs named rl-off-sN / rl-auto-sN
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tlt_rt.compare.batches import equal_work
from tlt_rt.compare.records import load_run, mean_se, paired_reward_gap, run_means, speedup

__all__ = ["find_pairs", "main", "plot_seeds", "seed_rows", "summary_lines", "write_seeds"]

PAIR_NAME = re.compile(r"^(?P<name>.+)-s(?P<seed>\d+)$")


def find_pairs(runs_dir: str | Path, base: str = "rl-off", run: str = "rl-auto") -> dict[int, tuple[Path, Path]]:
    """{seed: (baseline folder, run folder)} for every seed with both `BASE-sN` and `RUN-sN` under runs_dir."""
    found: dict[str, dict[int, Path]] = {base: {}, run: {}}
    for d in sorted(Path(runs_dir).iterdir()):
        m = PAIR_NAME.match(d.name)
        if d.is_dir() and m and m["name"] in found:
            found[m["name"]][int(m["seed"])] = d
    return {s: (found[base][s], found[run][s]) for s in sorted(found[base].keys() & found[run].keys())}


def seed_rows(pairs: dict[int, tuple[list[dict], list[dict]]], warmup: int = 2) -> list[dict]:
    """Per seed: steps compared, both mean step times, the speedup ± one standard error, the speedup at equal
    work and the paired reward gap (mean, standard error, steps). Pairs are cut to the steps both runs have."""
    rows = []
    for seed, (base, run) in sorted(pairs.items()):
        n = min(len(base), len(run))
        base, run = base[:n], run[:n]
        sp = speedup(base, run, warmup)
        same = equal_work(base, run, warmup)
        rows.append({
            "seed": seed, "steps": n,
            "base_step": run_means(base, warmup)["step_seconds"],
            "run_step": run_means(run, warmup)["step_seconds"],
            "speedup": sp[0] if sp else None, "speedup_se": sp[1] if sp else None,
            "equal_work": same["speedup"] if same else None,
            "reward_gap": paired_reward_gap(base, run),
        })  # fmt: skip
    return rows


def _across(vals: list[float]) -> str:
    if not vals:
        return "-"
    m, se = mean_se(vals)
    return f"{m:.2f}x ± {2 * se:.2f}" if len(vals) > 1 else f"{m:.2f}x"


def summary_lines(rows: list[dict], base: str = "rl-off", run: str = "rl-auto") -> list[str]:
    """The page: a row per seed, then the means over seeds with two standard errors of the seeds' spread, and
    whether the reward gap is within it."""

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    md = [f"{run} against {base}, one pair per seed (same config; the seed sets the prompts and the samples).", "",
          f"| seed | steps | {base} step s | {run} step s | speedup (± 1 SE) | at equal work | reward gap "
          "(± 2 SE over steps) |",
          "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x ± {r['speedup_se']:.2f}"
        gap = r["reward_gap"]
        g = "-" if gap is None else f"{gap[0]:+.3f} ± {2 * gap[1]:.3f} ({gap[2]} steps)"
        md.append(f"| {r['seed']} | {r['steps']} | {f(r['base_step'], '.2f')} | {f(r['run_step'], '.2f')} | {sp} | "
                  f"{f(r['equal_work'], '.2f')}{'x' if r['equal_work'] is not None else ''} | {g} |")  # fmt: skip
    md.append("")
    speeds = [r["speedup"] for r in rows if r["speedup"] is not None]
    same = [r["equal_work"] for r in rows if r["equal_work"] is not None]
    md.append(f"- over {len(rows)} seeds: speedup {_across(speeds)}, at equal work {_across(same)} (mean ± two "
              "standard errors of the seeds' spread)")  # fmt: skip
    gaps = [r["reward_gap"][0] for r in rows if r["reward_gap"] is not None]
    if len(gaps) > 1:
        m, se = mean_se(gaps)
        verdict = "within noise" if abs(m) <= 2 * se else "OUTSIDE the noise"
        md.append(f"- reward gap, {run} - {base}, over {len(gaps)} seeds: {m:+.3f} ± {2 * se:.3f} (two standard "
                  f"errors of the seeds' mean gaps): {verdict}")  # fmt: skip
    elif gaps:
        md.append("- reward gap: one seed only; the seeds' spread, the noise a learning comparison has to beat, "
                  "needs two or more")  # fmt: skip
    return md


def plot_seeds(rows: list[dict], path: Path) -> None:
    """Speedup (and at equal work) and the reward gap per seed, with their error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.4))
    seeds = [r["seed"] for r in rows]
    x = range(len(rows))
    sp = [(i, r["speedup"], r["speedup_se"]) for i, r in zip(x, rows, strict=True) if r["speedup"] is not None]
    if sp:
        a.errorbar([p[0] for p in sp], [p[1] for p in sp], yerr=[p[2] for p in sp], fmt="o", label="speedup ± 1 SE")
    same = [(i, r["equal_work"]) for i, r in zip(x, rows, strict=True) if r["equal_work"] is not None]
    if same:
        a.plot([p[0] + 0.1 for p in same], [p[1] for p in same], "s", label="at equal work")
    a.axhline(1.0, color="gray", lw=0.8)
    a.set_title("speedup per seed", fontsize=9)
    gaps = [(i, r["reward_gap"]) for i, r in zip(x, rows, strict=True) if r["reward_gap"] is not None]
    if gaps:
        b.errorbar([p[0] for p in gaps], [p[1][0] for p in gaps], yerr=[2 * p[1][1] for p in gaps], fmt="o",
                   label="paired over steps ± 2 SE")  # fmt: skip
    b.axhline(0.0, color="gray", lw=0.8)
    b.set_title("reward gap per seed (run - baseline)", fontsize=9)
    for ax in (a, b):
        ax.set_xticks(list(x), [str(s) for s in seeds])
        ax.set_xlabel("seed")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_seeds(pairs: dict[int, tuple[str | Path, str | Path]], out: str | Path, warmup: int = 2) -> Path:
    """OUT/seeds.md and OUT/seeds.png from {seed: (baseline folder, run folder)}; returns the page's path."""
    if not pairs:
        raise ValueError("no (baseline, run) pair to compare")
    loaded = {s: (load_run(b), load_run(r)) for s, (b, r) in pairs.items()}
    first = next(iter(pairs.values()))
    names = [PAIR_NAME.sub(r"\g<name>", Path(p).name) for p in first]
    rows = seed_rows(loaded, warmup)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_seeds(rows, out / "seeds.png")
    path = out / "seeds.md"
    path.write_text("\n".join([*summary_lines(rows, *names), "", "![seeds](seeds.png)", ""]))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt_rt.compare.seeds", description=__doc__.splitlines()[0])
    ap.add_argument("runs_dir", help="the folder holding rl-off-sN and rl-auto-sN run folders")
    ap.add_argument("--out", required=True, help="folder for seeds.md and seeds.png")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing means (default 2)")
    args = ap.parse_args(argv)
    try:
        path = write_seeds(find_pairs(args.runs_dir), args.out, args.warmup)
    except (FileNotFoundError, ValueError) as e:
        print(f"compare.seeds: {e}", file=sys.stderr)
        return 2
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
