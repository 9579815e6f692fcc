"""`python -m tlt_rt.compare RUN_DIR [RUN_DIR ...] --out DIR`: runs side by side.

For runs of the same config and seed that differ in one setting (typically SD auto + spot drafter training
against SD off), writes DIR/compare.md and DIR/compare.png so that a speedup and "the learning is unchanged"
read from one page:
- per run, the means of the step-time breakdown over the steps after `--warmup` (they carry start-up work:
  first captures, first compiles), and the speedup over the first run with its standard error;
- whether the learning agrees: per-step reward differences paired by step (same prompts), and the held-out
  accuracy with its binomial standard error;
- where the rollout's time goes per batch size (power-of-two buckets): seconds, tokens per second, SD share
  and accept length beside the perfect-drafter ceiling;
- the speedup at equal work: each run's tokens/s per batch size applied to the first run's tokens per batch
  size, so that the luck of how long the sampled tails ran drops out of the comparison;
- plain decoding steps' time per batch size by their place after a prefill or speculative step (what the SD
  policy prices plain decoding from, against plain steps once settled);
- the response-length histogram of the first steps (the tail the rollout waits for);
- with `logging.drafter_curve`, the online drafter's accept length against the frozen starting drafter's and
  the ceiling, on each step's answers (plotted beside the accept length).
`python -m tlt_rt.report RUN_A RUN_B` writes the same page; `python -m tlt_rt.compare.seeds RUNS --out DIR` reads
one such pair per seed (rl-off-sN / rl-auto-sN, as `benchmarks/e2e_rl.py --seeds` names them) together.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tlt_rt.compare.batches import bucket_table, buckets, equal_work, equal_work_lines, plain_step_table
from tlt_rt.compare.plot import plot_compare
from tlt_rt.compare.records import (
    COLUMNS,
    HIST_STEPS,
    agreement,
    compare_table,
    compile_lines,
    drafter_curve_lines,
    first_lengths,
    load_run,
    mean_se,
    measured,
    run_means,
    speedup,
)
from tlt_rt.train.rl.metrics import percentile

__all__ = [
    "COLUMNS", "agreement", "bucket_table", "buckets", "compare_table", "compile_lines", "drafter_curve_lines",
    "equal_work", "equal_work_lines", "first_lengths", "load_run", "main", "mean_se", "measured", "plain_step_table",
    "plot_compare", "run_means", "speedup", "write_compare",
]  # fmt: skip


def write_compare(run_dirs: list[str | Path], out: str | Path, warmup: int = 1) -> Path:
    if len(run_dirs) < 2:
        raise ValueError("compare needs at least two run folders")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    runs = {Path(d).name: load_run(d) for d in run_dirs}
    if len(runs) != len(run_dirs):
        raise ValueError("run folders must have distinct names")
    # a run cut short (a time limit) is compared on the steps all runs have: later steps have other answers
    common = min(len(r) for r in runs.values())
    cut = [n for n, r in runs.items() if len(r) > common]
    runs = {n: r[:common] for n, r in runs.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_compare(runs, out / "compare.png", warmup)
    names = list(runs)
    md = [f"Means over the steps after the first {warmup} (all steps when a run has no more); speedup = "
          f"{names[0]}'s mean step time / the run's, ± one standard error.", ""]  # fmt: skip
    if cut:
        md += [f"Only the first {common} steps are compared: {', '.join(cut)} ran more.", ""]
    md += compare_table(runs, warmup) + [""]
    for n in names[1:]:
        lines = agreement(runs[names[0]], runs[n])
        if lines:
            md += [f"Learning, {n} against {names[0]}:", "", *lines, ""]
    curve = drafter_curve_lines(runs)
    if curve:
        md += ["Drafter accept length on each step's answers, the online drafter against a frozen copy of the run's "
               "starting drafter (the ceiling's measure, a perfect drafter's):", "", *curve, ""]  # fmt: skip
    same = equal_work_lines(runs, warmup)
    if same:
        md += ["At equal work (each run's tokens/s per batch size applied to the first run's tokens per batch size, "
               "so that how long the sampled tails happened to be drops out):", "", *same, ""]  # fmt: skip
    slow = compile_lines(runs, warmup)
    if slow:
        md += ["Compiles inside the measured updates (each costs seconds once; the start-up warm-up is meant to leave "
               "none):", "", *slow, ""]  # fmt: skip
    table = bucket_table(runs, warmup)
    if table:
        md += ["Rollout time per batch size (running sequences, power-of-two buckets; measured steps):", "", *table, ""]
    table = plain_step_table(runs, warmup)
    if table:
        md += ["Plain steps by batch size and place after a prefill or speculative step (the SD policy prices plain "
               "decoding from the 3rd on, rollout.policy.plain_settle; median ms a step):", "", *table, ""]  # fmt: skip
    for n, records in runs.items():
        lengths = first_lengths(records)
        if lengths:
            p50, p99 = percentile(lengths, 50), percentile(lengths, 99)
            md.append(f"- {n}: response lengths of the first {min(HIST_STEPS, len(records))} steps: p50 {p50:.0f}, "
                      f"p99 {p99:.0f} ({p99 / max(p50, 1):.1f}x the median), max {max(lengths)}")  # fmt: skip
    md += ["", "![compare](compare.png)", ""]
    path = out / "compare.md"
    path.write_text("\n".join(md))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tlt_rt.compare", description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", help="run folders; the first is the baseline")
    ap.add_argument("--out", required=True, help="folder for compare.md and compare.png")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the timing means (default 1)")
    args = ap.parse_args(argv)
    try:
        path = write_compare(args.run_dirs, args.out, args.warmup)
    except (FileNotFoundError, ValueError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    print(path.read_text())
    return 0
