"""What prefilling a batch of prompts costs, by prefill chunk size, with and without a drafter.

    python benchmarks/prefill_cost.py --batch 128 --chunks 2048 16384 [--rounds 5] [--drafter DIR] [--profile 20]
    python benchmarks/prefill_cost.py --target MODEL --batch 1 8 --chunks 16384 --profile 25   # a Qwen checkpoint

Each (engine kind, chunk) pair is one engine on SmolLM2 (or `--target`'s model; bf16 on a GPU): `off` (no
drafter) and `auto` (a drafter, whose rows of every prompt run once at the fork of its samples,
`rollout/step/prefill.py`). One call
is `generate(prompts, max_new_tokens=1)`: the prompts' prefill steps and the fork that draws each first
token, nothing else. The rounds are interleaved (one call of every engine per round), so a slow stretch of
the device falls on all of them alike. Per engine: the median call in ms, its prefill steps, and the ratio
to `off` at the same chunk in the same round; `auto - off` is what the drafter's pass over the prompts
costs. A call at a large batch of 128-token answers spends about as long in prefill as in decoding
(engine_throughput.py's split), so prefill's cost moves every engine's tokens/s there.

`--profile N` runs one more call of each engine at the largest chunk under cProfile and one under the torch
profiler, and prints the N functions with the most own host time, the N engine functions with the most
cumulative time and the N kernels with the most device time: a call whose kernels take far less than its
wall time is host-bound.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import prompts_for  # noqa: E402  (the same prompts as the engine's benchmark)
from step_costs import append_jsonl, kernel_table, print_kernel_table  # noqa: E402

from tlt_rt.models.default import load_tokenizer  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_prefill(engine: Engine, prompts, device: str) -> tuple[float, int]:
    """(milliseconds, prefill steps) of one generate call that only prefills and forks."""
    steps = engine.stats()["prefill_steps"]
    sync(device)
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=1))
    sync(device)
    return 1e3 * (time.perf_counter() - t0), engine.stats()["prefill_steps"] - steps


def profile_call(engine: Engine, prompts, device: str, top: int, title: str) -> None:
    """One prefill call under cProfile (functions by own host time, the engine's by cumulative), then one
    under the torch profiler (kernels by device time, on CUDA)."""
    prof = cProfile.Profile()
    prof.enable()
    ms, _ = timed_prefill(engine, prompts, device)
    prof.disable()
    print(f"--- {title}: {ms:.1f} ms under cProfile; functions by own host time, then the engine's by cumulative")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats("tlt_rt", top)
    if device != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as kp:
        ms, _ = timed_prefill(engine, prompts, device)
    print_kernel_table(kernel_table(kp, 1), f"--- {title}: {ms:.1f} ms under the torch profiler", top)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[128])
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 16384], help="max_prefill_tokens values")
    ap.add_argument("--kinds", nargs="+", default=["off", "auto"], choices=["off", "auto"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", default=None, help="model folder, GGUF file or registry name (default: SmolLM2)")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="append the rows as JSON lines")
    ap.add_argument("--profile", type=int, default=0, help="print the N dearest engine functions and kernels")
    ap.add_argument("--graph-tokens", type=int, default=0,
                    help="also each kind with rollout.prefill_graph_tokens=N (a lone prompt's prefill captured), "
                         "labelled KIND+graph, in the same rounds")  # fmt: skip
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    tok = load_tokenizer(args.target)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    rows = []
    for b in args.batch:
        prompts = prompts_for(b, tok)
        engines = {}
        labels = [(k, 0) for k in args.kinds] + [(k, args.graph_tokens) for k in args.kinds if args.graph_tokens]
        for kind, graph_tokens in labels:
            for chunk in args.chunks:
                eng = Engine.from_pretrained(
                    args.target, drafter_path=args.drafter if kind != "off" else None, speculative=kind, dtype=dtype,
                    device=args.device, strategies=["8_4_32", "6_2_12"], max_batch=b, num_blocks=256 + 32 * b,
                    max_prefill_tokens=chunk, prefill_graph_tokens=graph_tokens,
                )  # fmt: skip
                if args.device == "cuda":
                    eng.warm_up()  # prefill runs eagerly: no captured steps, only first-use compiles
                timed_prefill(eng, prompts, args.device)  # and prefill's own shapes (and a graph's capture)
                engines[(kind + ("+graph" if graph_tokens else ""), chunk)] = eng
        ms = {key: [] for key in engines}
        steps = {}
        for _ in range(args.rounds):
            for key, eng in engines.items():
                t, steps[key] = timed_prefill(eng, prompts, args.device)
                ms[key].append(t)
        tokens = sum(len(p) for p in prompts)
        for (kind, chunk), t in ms.items():
            base = ms.get(("off", chunk))
            ratio = statistics.median(a / c for a, c in zip(t, base, strict=True)) if base else None
            rows.append(dict(batch=b, kind=kind, chunk=chunk, prompt_tokens=tokens, ms=statistics.median(t),
                             ms_all=t, prefill_steps=steps[(kind, chunk)], x_off=ratio))  # fmt: skip
        if args.profile:
            for kind in dict.fromkeys(k for k, _ in engines):
                chunk = max(args.chunks)
                profile_call(engines[(kind, chunk)], prompts, args.device, args.profile, f"{kind} b={b} chunk {chunk}")
        del engines
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}; one call = prefill + fork (first tokens), median of {args.rounds} interleaved rounds")
    print(f"{'batch':>5} {'tokens':>7} {'kind':>10} {'chunk':>6} {'steps':>5} {'ms':>8} {'x off':>6}")
    for r in rows:
        ratio = f"{r['x_off']:.3f}" if r["x_off"] is not None else "-"
        print(f"{r['batch']:5d} {r['prompt_tokens']:7d} {r['kind']:>10} {r['chunk']:6d} {r['prefill_steps']:5d} "
              f"{r['ms']:8.1f} {ratio:>6}")  # fmt: skip
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
