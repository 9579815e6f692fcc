"""The end-to-end RL figure in one command: SD auto + spot drafter training against SD off, same config and
seed, then the comparison page (tlt_rt/compare/: step time and its breakdown, speedup ± standard error,
reward and held-out accuracy overlaid, accept length beside the perfect-drafter ceiling, time per batch size,
the response-length histogram).

    python benchmarks/e2e_rl.py --steps 20 --out runs/e2e            # GPU; configs/smollm2-tail-gpu.yaml
    python benchmarks/e2e_rl.py --steps 20 --out runs/e2e -- rl.lr=1e-6   # keys after -- go to both runs
    python benchmarks/e2e_rl.py --steps 16 --seeds 0 1 2 --out runs/e2e   # a pair per seed, then OUT/seeds.md
    python benchmarks/e2e_rl.py --steps 16 --hold-policy --out runs/e2e   # rl.lr=0: the samplers alone

Stages: (1) unless --drafter is given, a drafter warm-up on the config's own task (the target's answers at
the RL temperature, tlt_rt.train.drafter.warmup), which both runs are given (the off run never loads it);
(2) the off run; (3) the auto + spot run; (4) the page, printed and written to OUT/compare.md. Timing means
leave out the first --timing-warmup steps (captures, first compiles, the auto policy's first readings).

Two runs that sample differently learn from different answers, so their policies part from the first update
and a reward gap between one pair is partly where each policy happened to go. `--seeds` repeats the pair per
seed and judges the mean gap against the seeds' spread (`tlt_rt.compare.seeds`); `--hold-policy` keeps one policy
throughout (rl.lr=0), so that the pair's reward gap measures the samplers alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tlt_rt.compare import write_compare  # noqa: E402
from tlt_rt.compare.seeds import write_seeds  # noqa: E402
from tlt_rt.config import TLTConfig, dump_yaml, load_config  # noqa: E402

STARTUP_S = 100  # a GPU run's start-up before its first step (SmolLM2 on an H100: Ray, load, captures)


def warm_drafter(
    config: str,
    keys: list[str],
    out: Path,
    prompts: int,
    epochs: float,
    max_new_tokens: int,
    strategy: str,
    curve: int = 0,
    lr_schedule: str = "cosine",
    extra: tuple[str, ...] = (),
) -> Path:
    """The drafter warm-up (tlt_rt.train.drafter.warmup) on the config's task, in its own process: its engines
    hold half the GPU's memory each, and all of it goes back when that process ends."""
    cfg = load_config(TLTConfig, config, keys)
    if cfg.task.kind != "arithmetic":
        raise SystemExit(f"e2e_rl: the drafter warm-up generates arithmetic prompts; task.kind is {cfg.task.kind}. "
                         "Warm one up on your data and pass --drafter DIR")  # fmt: skip
    if max_new_tokens <= 0:  # the RL runs' own answer length: the drafter meets positions as far as theirs
        max_new_tokens = cfg.rollout.max_new_tokens
    cfg_file = out.parent / "warmup-config.yaml"
    cfg_file.write_text(dump_yaml(cfg))
    cmd = [sys.executable, "-m", "tlt_rt.train.drafter.warmup", "--config", str(cfg_file), "--out", str(out),
           "--prompts", str(prompts), "--held-out", "32", "--samples", "4", "--epochs", str(epochs),
           "--max-new-tokens", str(max_new_tokens), "--temperature", str(cfg.rollout.temperature),
           "--eval-temperatures", "--strategy", strategy, "--curve", str(curve),
           "--lr-schedule", lr_schedule]  # fmt: skip
    if cfg.model.path:
        cmd += ["--target", str(cfg.model.path)]
    if cfg.drafter.draft_vocab:  # the run's reduced head from the start: its captured steps keep that size
        cmd += ["--draft-vocab", str(cfg.drafter.draft_vocab)]
    # the run's training-time-test passes: the warm-up trains the objective the online drafter goes on with
    cmd += ["--unroll", str(cfg.drafter.unroll)]
    if cfg.drafter.warmup_lr > 0:  # the config's peak rate, else the warm-up's width rule
        cmd += ["--lr", str(cfg.drafter.warmup_lr)]
    if cfg.drafter.feature_layers:  # EAGLE-3 features: the run's drafter fuses these target layers
        cmd += ["--feature-layers", *map(str, cfg.drafter.feature_layers)]
    cmd += extra  # last: an argument given twice takes its last value
    print(f"== drafter warm-up: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (out.parent / "warmup.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(
            f"e2e_rl: the drafter warm-up failed (exit {done.returncode}); see {out.parent / 'warmup.log'}"
        )
    for line in done.stdout.splitlines()[-3:]:
        print(f"   {line}", flush=True)
    print(f"== drafter warm-up: {time.time() - t0:.0f}s", flush=True)
    return out


def steps_done(run_dir: Path) -> int:
    """RL steps a run logged (its metrics.jsonl lines with a step number)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    with path.open() as f:
        return sum(1 for line in f if line.strip() and "step" in json.loads(line))


def run(config: str, out: Path, name: str, steps: int, keys: list[str], budget: float) -> int:
    """One training run as its own process (its own Ray); its console goes to OUT/NAME.log, step lines here.
    With a budget the run stops itself after the step that passes it (rl.time_limit_s); should a step hang
    past it by far, the run's process group gets SIGINT (the trainer shuts its Ray workers down), then SIGKILL."""
    cmd = [sys.executable, "-m", "tlt_rt.train", config, f"name={name}", f"output_dir={out / 'runs'}",
           f"rl.steps={steps}", *keys]  # fmt: skip
    if budget < float("inf"):  # start-up (Ray, model, graph captures) comes before the run's own clock starts
        cmd.append(f"rl.time_limit_s={max(30.0, budget - STARTUP_S):.0f}")
    print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        watchdog = threading.Timer(budget * 1.5 + 60, _stop, (proc, name)) if budget < float("inf") else None
        if watchdog is not None:
            watchdog.start()
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(("[step ", "rl.time_limit_s")) or "Error" in line:
                    print(f"   {line.rstrip()}", flush=True)
        finally:
            rc = proc.wait()
            if watchdog is not None:
                watchdog.cancel()
    print(f"== {name}: exit {rc} after {time.time() - t0:.0f}s", flush=True)
    return rc


def _stop(proc: subprocess.Popen, name: str) -> None:
    print(f"== {name}: past its time budget; stopping it", flush=True)
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    keys = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2-tail-gpu.yaml"))
    ap.add_argument("--steps", type=int, default=20, help="RL steps of each run")
    ap.add_argument("--timing-warmup", type=int, default=2, help="first steps left out of the timing means")
    ap.add_argument("--out", default=f"runs/e2e-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--drafter", default=None, help="a warmed-up drafter (run, checkpoint or EAGLE folder)")
    ap.add_argument("--fresh-drafter", action="store_true", help="no warm-up: the auto run starts from a fresh drafter")
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="drafter warm-up: prompts, 4 answers each (default: drafter.warmup_prompts)")  # fmt: skip
    ap.add_argument("--warmup-epochs", type=float, default=None,
                    help="drafter warm-up: passes over its data (default: drafter.warmup_epochs)")  # fmt: skip
    ap.add_argument("--warmup-max-new-tokens", type=int, default=None,
                    help="drafter warm-up: answer length cap, 0 = the config's rollout.max_new_tokens (default: "
                    "drafter.warmup_max_new_tokens)")  # fmt: skip
    ap.add_argument("--strategy", default="8_4_32", help="drafter warm-up: the strategy its accept length uses")
    ap.add_argument("--warmup-curve", type=int, default=0,
                    help="drafter warm-up: points of its accept-vs-training-tokens curve (0 = none)")  # fmt: skip
    ap.add_argument("--warmup-lr-schedule", choices=("constant", "cosine"), default="cosine",
                    help="drafter warm-up: a linear rise over its first steps, then a cosine fall")  # fmt: skip
    ap.add_argument("--warmup-arg", action="append", default=[], metavar="ARG",
                    help="drafter warm-up: one more argument of tlt_rt.train.drafter.warmup, as "
                    "--warmup-arg=--unroll=5 (repeatable)")  # fmt: skip
    ap.add_argument("--warmup-only", action="store_true",
                    help="stop after the drafter warm-up (OUT/drafter, OUT/warmup.log): variants side by side, then "
                    "the runs with --drafter")  # fmt: skip
    ap.add_argument("--checkpoints", action="store_true",
                    help="let the runs write their checkpoints (default: none, rl.checkpoint_every=0: the timing "
                    "would include writing them, and a 1.5B policy's are ~25 GB each)")  # fmt: skip
    ap.add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED",
                    help="one off / auto pair per seed (rl.seed; runs rl-off-sN / rl-auto-sN, each pair's page in "
                    "OUT/seedN), then OUT/seeds.md: speedup and reward gap per seed and over the seeds, whose "
                    "spread is the noise a learning comparison has to beat (default: the config's seed, one "
                    "pair)")  # fmt: skip
    ap.add_argument("--hold-policy", action="store_true",
                    help="rl.lr=0 and no held-out evaluation in both runs: one policy throughout, so a reward gap "
                    "between them measures the samplers alone")  # fmt: skip
    ap.add_argument(
        "--time-limit",
        type=float,
        default=0,
        help="seconds for everything: the off run gets 45%% of what the warm-up leaves (with --seeds, of each "
        "seed's equal share of it), the auto run the rest and the steps the off run reached (0 = no limit)",
    )
    args = ap.parse_args(argv)
    if args.steps <= args.timing_warmup:
        ap.error(f"--steps ({args.steps}) must exceed --timing-warmup ({args.timing_warmup})")
    cfg = load_config(TLTConfig, args.config, keys)  # fails here, not in a subprocess, on a bad key
    for name in ("warmup_prompts", "warmup_epochs", "warmup_max_new_tokens"):  # what the command line leaves open
        if getattr(args, name) is None:
            setattr(args, name, getattr(cfg.drafter, name))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    drafter = args.drafter
    if drafter is None and not args.fresh_drafter:
        drafter = str(warm_drafter(args.config, keys, out / "drafter", args.warmup_prompts, args.warmup_epochs,
                                   args.warmup_max_new_tokens, args.strategy, args.warmup_curve,
                                   args.warmup_lr_schedule, tuple(args.warmup_arg)))  # fmt: skip
    if args.warmup_only:
        if drafter is None:
            ap.error("--warmup-only with --drafter or --fresh-drafter has nothing to do")
        return 0

    def left() -> float:  # what the time limit leaves
        return max(60.0, args.time_limit - (time.time() - t0)) if args.time_limit else float("inf")

    shared = [*keys, f"drafter.path={drafter}"] if drafter else list(keys)
    if not args.checkpoints and not any(k.startswith("rl.checkpoint_every=") for k in keys):
        shared.insert(0, "rl.checkpoint_every=0")
    if args.hold_policy:  # the samplers alone: one policy throughout, nothing to evaluate
        shared += ["rl.lr=0", "logging.eval_every=0"]
    if not args.seeds:
        end = time.time() + left()
        return pair(args, out, out, "", shared, end, t0)
    rc, pairs = 0, {}
    for i, seed in enumerate(args.seeds):  # each pair an equal share of what the time limit leaves
        end = time.time() + left() / (len(args.seeds) - i)
        rc |= pair(args, out, out / f"seed{seed}", f"-s{seed}", [*shared, f"rl.seed={seed}"], end, t0)
        named = (out / "runs" / f"rl-off-s{seed}", out / "runs" / f"rl-auto-s{seed}")
        if all((r / "metrics.jsonl").is_file() for r in named):
            pairs[seed] = named
    if not pairs:
        print("e2e_rl: no seed's pair wrote steps; see the logs in", out, file=sys.stderr)
        return 1
    page = write_seeds(pairs, out, warmup=args.timing_warmup)
    print(page.read_text())
    print(f"seeds page: {page}  plot: {page.with_suffix('.png')}  ({time.time() - t0:.0f}s in all)")
    return rc


def pair(args, out: Path, page_dir: Path, suffix: str, shared: list[str], end: float, t0: float) -> int:
    """The off run, then the auto run (OUT/runs/rl-off|rl-auto + SUFFIX, logs in OUT), then their page in PAGE_DIR.
    Before END (inf: no limit) the off run gets 45% of the time left; the auto run (the longer start-up: drafter
    graphs) the rest, and stops at the steps the off run reached, so the time goes to the steps both have."""
    names = (f"rl-off{suffix}", f"rl-auto{suffix}")
    runs = [out / "runs" / n for n in names]

    def until_end() -> float:
        return max(60.0, end - time.time()) if end < float("inf") else float("inf")

    rc = run(args.config, out, names[0], args.steps, [*shared, "rollout.speculative=off", "drafter.train_online=false"],
             0.45 * until_end())  # fmt: skip
    steps = min(args.steps, max(steps_done(runs[0]), args.timing_warmup + 1))
    rc |= run(args.config, out, names[1], steps, [*shared, "rollout.speculative=auto"], until_end())
    if not all((r / "metrics.jsonl").is_file() for r in runs):
        print("e2e_rl: a run wrote no steps; see its log in", out, file=sys.stderr)
        return 1
    page_dir.mkdir(parents=True, exist_ok=True)
    for r, plain in zip(runs, ("rl-off", "rl-auto"), strict=True):  # the records beside the page, no checkpoints
        for f in ("metrics.jsonl", "timelines.jsonl"):
            if (r / f).is_file():
                shutil.copy(r / f, page_dir / f"{plain}.{f}")
    page = write_compare(runs, page_dir, warmup=args.timing_warmup)
    print(page.read_text())
    print(f"page: {page}  plot: {page.with_suffix('.png')}  ({time.time() - t0:.0f}s in all)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
