"""Where a speculation-capable engine's plain steps spend more than a plain engine's (GPU).

    python benchmarks/plain_gap.py --batch 1 8 32 128 --rounds 3 [--max-new-tokens 128] [--out F.jsonl]

Two engines on SmolLM2 bf16 and the same prompts: "off" (no drafter) and "auto" (speculation auto, a
drafter, hidden rows kept as every engine with a drafter keeps them), whose policy still decides every step
(its host cost counts) but is overruled to plain decoding, so both engines run the same captured plain step.
Rounds interleave one greedy generate call of each. Per engine and batch, the mean decode step (the engine's
timeline) and its parts in microseconds:

    policy   the policy's decide and observe (and auto's count of rows the drafter is behind)
    inputs   ModelRunner.step_args: the packed step inputs on the host
    launch   ModelRunner.run_args: the copy into the graph's inputs and the replay, as queued by the host
    wait     the rest of ModelRunner.step: the wait for the result copy, parsing, keeping hidden rows
    post     Scheduler.postprocess: tokens, stops, hidden rows of every sequence
    device   CUDA-event time of the queued copy and replay
    gc       Python's garbage collector, per step
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import prepare_engine, prompts_for  # noqa: E402
from step_costs import append_jsonl  # noqa: E402

from tlt_rt.models.default import load_tokenizer  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402

PARTS = ("policy", "inputs", "launch", "wait", "post", "device", "gc")


class Clock:
    """Per-part seconds of one engine, summed over the steps of the calls it times."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.on = False

    def wrap(self, part: str, fn):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.sums[part] += time.perf_counter() - t0

        return timed

    def settle(self) -> None:
        """Add the device time of the recorded events (after a synchronize)."""
        self.sums["device"] += sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        self.events.clear()


def instrument(engine: Engine, clock: Clock, overrule: bool) -> None:
    runner = engine.runner
    step_args, run_args, step = runner.step_args, runner.run_args, runner.step

    def run_timed(*a, **k):
        if not clock.on:
            return run_args(*a, **k)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run_args(*a, **k)
        end.record()
        clock.events.append((start, end))
        return out

    def step_timed(*a, **k):  # "wait" is the step's time less its inputs and launch
        before = clock.sums["inputs"] + clock.sums["launch"]
        t0 = time.perf_counter()
        out = step(*a, **k)
        if clock.on:
            clock.sums["wait"] += time.perf_counter() - t0 - (clock.sums["inputs"] + clock.sums["launch"] - before)
        return out

    runner.step_args = clock.wrap("inputs", step_args)
    runner.run_args = clock.wrap("launch", run_timed)
    runner.step = step_timed
    policy = engine.policy
    decide = clock.wrap("policy", policy.decide)
    policy.decide = (lambda *a, **k: (decide(*a, **k), None)[1]) if overrule else decide
    policy.observe = clock.wrap("policy", policy.observe)
    make = engine.scheduler

    def scheduler(*a, **k):
        sched = make(*a, **k)
        sched.postprocess = clock.wrap("post", sched.postprocess)
        return sched

    engine.scheduler = scheduler


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--strategies", nargs="+", default=["8_4_32", "6_2_12"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    tok = load_tokenizer(None)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    rows = []
    gc_time = [0.0, None]

    def on_gc(phase, info):
        if phase == "start":
            gc_time[1] = time.perf_counter()
        elif gc_time[1] is not None:
            gc_time[0] += time.perf_counter() - gc_time[1]

    gc.callbacks.append(on_gc)
    for b in args.batch:
        prompts = prompts_for(b, tok)
        engines, clocks, steps = {}, {}, defaultdict(list)
        for name in ("off", "auto"):
            engines[name] = Engine.from_pretrained(None, speculative=name, dtype="bfloat16", device="cuda",
                                                   strategies=args.strategies, max_batch=b,
                                                   num_blocks=256 + 32 * b, overlap=False)  # fmt: skip
            clocks[name] = Clock()
            instrument(engines[name], clocks[name], overrule=name == "auto")
            prepare_engine(engines[name], prompts)
        for _ in range(args.rounds):
            for name, eng in engines.items():
                clock = clocks[name]
                n0, g0 = len(eng.timeline), gc_time[0]
                clock.on = True
                eng.generate(prompts, params)
                torch.cuda.synchronize()
                clock.on = False
                clock.settle()
                clock.sums["gc"] += gc_time[0] - g0
                steps[name] += [e["seconds"] for e in eng.timeline[n0:] if e["kind"] == "decode"]
        for name in engines:
            n = max(len(steps[name]), 1)
            mean, median = statistics.fmean(steps[name]), statistics.median(steps[name])
            row = {"batch": b, "engine": name, "steps": len(steps[name])}
            row.update(step_us=1e6 * mean, median_us=1e6 * median)
            row.update({p: 1e6 * clocks[name].sums[p] / n for p in PARTS})
            rows.append(row)
        del engines
        gc.collect()
        torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}; microseconds per plain decode step (mean over the timed calls)")
    print(f"{'batch':>5} {'engine':6} {'steps':>5} {'step':>7} {'median':>7} " + " ".join(f"{p:>7}" for p in PARTS))
    for r in rows:
        cells = " ".join(f"{r[p]:7.1f}" for p in PARTS)
        print(f"{r['batch']:5d} {r['engine']:6} {r['steps']:5d} {r['step_us']:7.1f} {r['median_us']:7.1f} {cells}")
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
