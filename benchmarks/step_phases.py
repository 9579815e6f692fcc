"""Where a speculative step's GPU kernels go, phase by phase (GPU).

    python benchmarks/step_phases.py --batch 1 32 --strategies 8_4_32 6_2_12 [--show 12] [--out F.jsonl]

One engine (SmolLM2 bf16, speculation on) runs its steps eagerly with the kernels its captured steps
replay (compiled glue, Triton attention, the Triton rerank), each node of the step's program under a
profiler range (ir/program.py): the drafter's catch-up block, the draft levels (their attention inputs and
top-k apart), the rerank into the verify tree (ROOT for plain decoding), the target's verify, acceptance, the KV
commit, the output (hidden rows, windows, the host's tensor), and the rest (the step's own input unpacking).
The torch profiler gives each phase's kernels: launches and time.
Launch counts are what a captured step replays; the time is the kernels' own (no launch gaps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import prompts_for  # noqa: E402
from step_ratio import Rotation  # noqa: E402

import tlt_rt.codegen.draft as draft  # noqa: E402
from tlt_rt.ir.strategy import Strategy  # noqa: E402
from tlt_rt.models.default import load_tokenizer  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402

# a phase per node of the step program, the levels' attention inputs and every top-k apart
PHASES = ["catchup", "level", "level-meta", "topk", "rerank", "root", "verify", "accept", "commit", "output", "rest",
          "unattributed"]  # fmt: skip


def _ranged(fn, label: str):
    def wrapped(*a, **k):
        with record_function(f"phase:{label}"):
            return fn(*a, **k)

    wrapped.__name__ = getattr(fn, "__name__", label)
    return wrapped


def instrument(engine: Engine) -> None:
    """Profiler ranges around each node of the engine's lowered steps, and inside them around the levels'
    attention inputs and every top-k (`codegen.draft`'s functions, looked up there at each call)."""
    draft.level_meta = _ranged(draft.level_meta, "level-meta")
    draft.top_children = _ranged(draft.top_children, "topk")
    steps = engine.runner.steps
    lowered = steps.lowered

    def lowered_ranged(batch, option, mode):
        low = lowered(batch, option, mode)
        return dataclasses.replace(low, calls=tuple((op, _ranged(fn, op.lower())) for op, fn in low.calls))

    steps.lowered = lowered_ranged


def _innermost(ranges, t: int) -> str:
    best, width = "rest", None
    for a, b, name in ranges:
        if a <= t <= b and (width is None or b - a < width):
            best, width = name, b - a
    return best


def kernels_by_phase(prof) -> dict[str, list]:
    """{phase: [launches, us, Counter(kernel name: launches), Counter(kernel name: us)]}: each device kernel
    or copy goes to the innermost phase range open when the host launched it (runtime launch and device
    activity share a correlation id; Triton launches are no aten op, so the profiler's own op-to-kernel
    links would miss them)."""
    raw = list(prof.profiler.kineto_results.events())
    cpu = [e for e in raw if e.device_type() == DeviceType.CPU]
    ranges = [
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[6:]) for e in cpu if e.name().startswith("phase:")
    ]
    launched = {
        e.correlation_id(): e.start_ns() for e in cpu if e.name().startswith(("cuda", "cu")) and e.correlation_id()
    }
    out: dict[str, list] = defaultdict(lambda: [0, 0.0, Counter(), Counter()])
    for e in raw:
        if e.device_type() != DeviceType.CUDA or e.name().startswith("phase:"):
            continue  # a phase's own range on the device's timeline is no kernel
        t = launched.get(e.correlation_id())
        row = out["unattributed" if t is None else _innermost(ranges, t)]
        row[0] += 1
        row[1] += e.duration_ns() / 1e3
        row[2][e.name()[:90]] += 1
        row[3][e.name()[:90]] += e.duration_ns() / 1e3
    return out


def profile_step(engine: Engine, prompts, option, at: int = 6):
    """{phase: (launches, kernel us, launches and us by kernel name)} of the `at`-th step of `option`."""
    engine.policy = Rotation([option])
    step, seen, profs = engine.runner.step, [0], []

    def one(*a, **k):
        seen[0] += 1
        if seen[0] != at:
            return step(*a, **k)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("phase:rest"):
                res = step(*a, **k)
            torch.cuda.synchronize()
        profs.append(prof)
        return res

    engine.runner.step = one
    try:
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=at + 4, stop_token_ids=[]))
    finally:
        engine.runner.step = step
    return kernels_by_phase(profs[0])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--strategies", nargs="+", default=["8_4_32", "6_2_12"])
    ap.add_argument("--show", type=int, default=8, help="kernels of each phase with the most time")
    ap.add_argument("--out", default=None, help="append one JSON line per (batch, option)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft over N target ids (a reduced head, ids 0..N-1: costs, not gains)")  # fmt: skip
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    tok = load_tokenizer(None)
    options = [None, *(Strategy.parse(s) for s in args.strategies)]
    table = []
    for b in args.batch:
        engine = Engine.from_pretrained(None, speculative="on", dtype="bfloat16", device="cuda",
                                        strategies=args.strategies, max_batch=max(b, 1),
                                        num_blocks=256 + 32 * b)  # fmt: skip
        if args.draft_vocab:
            engine.drafter_runner.drafter.set_draft_vocab(torch.arange(args.draft_vocab))
        # the captured step's kernels (compiled glue, Triton attention, compiled rerank), run eagerly
        engine.runner.pool = None
        instrument(engine)
        prompts = prompts_for(b, tok)
        for option in options:
            profile_step(engine, prompts, option)  # warm: compiles, allocator
            got = profile_step(engine, prompts, option)
            name = str(option) if option else "off"
            row = {"batch": b, "option": name, "device": torch.cuda.get_device_name(),
                   "draft_vocab": args.draft_vocab or None}  # fmt: skip
            for ph in PHASES:
                n, us, names, times = got.get(ph, (0, 0.0, Counter(), Counter()))
                row[f"{ph}_launches"], row[f"{ph}_us"] = n, round(us, 1)
                for k, t in times.most_common(args.show):
                    print(f"  b={b:<3} {name:7} {ph:10} {names[k]:4}x {t:7.1f} us  {k}")
            table.append(row)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    vocab = f"; draft vocabulary {args.draft_vocab}" if args.draft_vocab else ""
    print(f"device: {torch.cuda.get_device_name()}; kernel launches / kernel us of one step, by phase{vocab}")
    print("batch option  " + " ".join(f"{p:>13}" for p in PHASES) + "         total")
    for r in table:
        cells = " ".join(f"{r[p + '_launches']:4d}/{r[p + '_us']:7.1f}" for p in PHASES)
        tot = sum(r[p + "_launches"] for p in PHASES), sum(r[p + "_us"] for p in PHASES)
        print(f"{r['batch']:5d} {r['option']:7} {cells} {tot[0]:5d}/{tot[1]:7.1f}")


if __name__ == "__main__":
    main()
