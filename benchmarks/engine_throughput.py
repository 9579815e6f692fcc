"""Rollout throughput: tokens/s of the engine (SD off, each strategy, auto) against transformers' generate.

    python benchmarks/engine_throughput.py --batch 1 4 16 64 --max-new-tokens 128 [--drafter DIR]
    python benchmarks/engine_throughput.py --target qwen2.5-coder-1.5b-instruct --drafter DIR --temperature 1 \
        --task-config configs/qwen2.5-1.5b-math-gpu.yaml --configs off auto --interleave --batch 1 8 32 128

Prompts are arithmetic problems from the default task (or `--task-config`'s, the RL workload's), formatted
with the target's chat template. Greedy decoding by default, so every provider emits the same tokens up to
stop and the comparison is like for like; with `--temperature` > 0 every engine samples (exactly, each its
own draws), so a row's tokens differ from off's and only rates compare. The peer is transformers' `generate`
(plain, and with prompt-lookup decoding) on the same model and prompts, greedy. Without --drafter the
engine's drafter is freshly initialised: SD rows then measure overhead, not gain. The target is loaded once
and shared by every row's engine.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_costs import append_jsonl, kernel_table, print_kernel_table  # noqa: E402

from tlt_rt.models.default import load_tokenizer  # noqa: E402
from tlt_rt.models.loader import load_target, resolve_model_path  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402
from tlt_rt.rollout.stats import timeline_split  # noqa: E402
from tlt_rt.train.rl.data import ArithmeticTask, format_prompt  # noqa: E402

TEMPERATURE = 0.0  # of every timed call; main() sets it from --temperature


def prompts_for(n: int, tok, task: ArithmeticTask | None = None) -> list[list[int]]:
    task = task or ArithmeticTask(digits=2, num_ops=2, seed=1)
    return [format_prompt(p, tok) for p in task.sample(n)]


def params_for(max_new: int) -> SamplingParams:
    """The timed calls' sampling: greedy, or TEMPERATURE with a fixed seed (each call draws the same stream)."""
    return SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new, seed=1 if TEMPERATURE > 0 else 0)


def prepare_engine(engine: Engine, prompts) -> None:
    """Every graph up front (lazy captures would land inside a timed call), then a warm-up call on the same
    prompts: prefill shapes compile there, and the policy takes its first step costs."""
    engine.capture(modes=("greedy",) if TEMPERATURE == 0 else ("sampled",))  # what the timed calls run
    engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=8))
    torch.cuda.synchronize()


def story(entries: list[dict]) -> str:
    """A call's steps as runs of one option: `8_4_32 x20 b128-120 5.71ms` (steps, batch from-to, mean ms)."""
    runs: list[list] = []
    for e in entries:
        name = "prefill" if e["kind"] == "prefill" else e["strategy"] or "off"
        if runs and runs[-1][0] == name:
            runs[-1][1].append(e)
        else:
            runs.append([name, [e]])
    parts = []
    for name, es in runs:
        ms = 1e3 * statistics.fmean(e["seconds"] for e in es)
        b0, b1 = es[0]["batch"], es[-1]["batch"]
        parts.append(f"{name} x{len(es)} b{b0}" + (f"-{b1}" if b1 != b0 else "") + f" {ms:.2f}ms")
    return " | ".join(parts)


def timed_call(
    engine: Engine, prompts, params: SamplingParams, split: list | None = None, stories: list | None = None
) -> tuple[float, int]:
    """(tokens/s, tokens) of one generate call; `split` gets the call's milliseconds by kind of step
    (prefill / decode / sd) and the rest of the call ("other": host work between steps, set-up, the end),
    `stories` the call's steps as runs of one option (`story`) and its milliseconds."""
    first = len(engine.timeline)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0  # the clock stops before the tokens are counted on the host
    n = sum(len(o.token_ids) for o in outs)
    if split is not None:
        seconds = timeline_split(engine.timeline[first:], dt)
        split.append({k: 1e3 * seconds[f"{k}_seconds"] for k in ("prefill", "decode", "sd", "other")})
    if stories is not None:
        stories.append(f"{1e3 * dt:.1f} ms: {story(engine.timeline[first:])}")
    return n / dt, n


def run_interleaved(
    engines: dict[str, Engine], prompts, max_new: int, repeats: int, learn_rounds: int = 0, stories: bool = False
) -> dict[str, dict]:
    """Every engine prepared, then `repeats` rounds of one timed call per engine in turn, so that a slow
    stretch of the device (clocks, other load) falls on every configuration alike. Per configuration: the
    median tokens/s and the median over rounds of its ratio to `off` in the same round. `learn_rounds`
    untimed full calls per engine come first: an engine that lives across calls (an RL run's) has had them,
    and `auto`'s policy takes its step costs and accept lengths there. `stories`: keep every timed call's
    steps as runs of one option (`story`)."""
    params = params_for(max_new)
    for eng in engines.values():
        prepare_engine(eng, prompts)
    for _ in range(learn_rounds):
        for eng in engines.values():
            timed_call(eng, prompts, params)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    splits: dict[str, list[dict]] = {name: [] for name in engines}
    told: dict[str, list[str]] = {name: [] for name in engines}
    n = 0
    for _ in range(repeats):
        for name, eng in engines.items():
            tps, n = timed_call(eng, prompts, params, splits[name], told[name] if stories else None)
            rates[name].append(tps)
    base = rates.get("off")
    out = {}
    for name, r in rates.items():
        ratios = [a / b for a, b in zip(r, base, strict=True)] if base else []
        out[name] = dict(tokens_per_s=statistics.median(r), tokens=n, rates=r,
                         paired_ratio=statistics.median(ratios) if ratios else None,
                         call_ms=median_split(splits[name]), stories=told[name])  # fmt: skip
    return out


def median_split(splits: list[dict]) -> dict:
    """Per kind, the median over timed calls of its milliseconds a call."""
    return {k: statistics.median(s[k] for s in splits) for k in splits[0]} if splits else {}


def run_engine(
    engine: Engine, prompts, max_new: int, profile: int = 0, repeats: int = 3, kernels: int = 0
) -> tuple[float, int]:
    """Median tokens/s over `repeats` timed generate calls, after capturing every graph and a warm-up call.
    The engine keeps its policy state across calls, as it does across RL steps. With `profile` > 0 the last
    call also runs under cProfile and the `profile` functions with the most own host time are printed (GPU
    waits show up in the call that synchronises, e.g. `.cpu()`). With `kernels` > 0 one more (untimed) call runs
    under the torch profiler and the `kernels` GPU kernels with the most time per engine step are printed."""
    params = params_for(max_new)
    prepare_engine(engine, prompts)
    rates, n, splits = [], 0, []
    for i in range(repeats):
        prof = cProfile.Profile() if profile and i == repeats - 1 else None
        steps0 = engine.stats()["steps"]
        if prof:
            prof.enable()
        tps, n = timed_call(engine, prompts, params, splits if not prof else None)
        rates.append(tps)
        if prof:
            prof.disable()
            steps = engine.stats()["steps"] - steps0
            print(f"--- profile: {len(prompts)} prompts, {steps} steps, {1e3 * n / tps / max(steps, 1):.2f} ms/step "
                  "(profiled)")  # fmt: skip
            pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
            print("--- the engine's own functions by cumulative time")
            pstats.Stats(prof).sort_stats("cumulative").print_stats("tlt_rt", profile)
    if kernels:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        steps0, t0 = engine.stats()["steps"], time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as kp:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        steps = max(engine.stats()["steps"] - steps0, 1)
        ms = 1e3 * (time.perf_counter() - t0) / steps
        title = f"--- kernels: {len(prompts)} prompts, {steps} steps, {ms:.2f} ms/step (profiled), per step"
        print_kernel_table(kernel_table(kp, steps), title, kernels)
    return statistics.median(rates), n, median_split(splits)


def run_hf(prompts, max_new: int, lookup: bool, target=None) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path(target)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    total, t_all = 0, 0.0
    for p in prompts:  # transformers' prompt lookup runs at batch 1
        ids = torch.tensor([p], device="cuda")
        kw = {"prompt_lookup_num_tokens": 10} if lookup else {}
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, **kw)
        torch.cuda.synchronize()
        t_all += time.perf_counter() - t0
        total += out.shape[1] - len(p)
    return total / t_all, total


def load_drafter(path, target):
    """A drafter from `path` (an EAGLE folder, a drafter or run checkpoint) for `target`; None: the engine's
    fresh one."""
    if path is None:
        return None
    # local: as load_target, only a given drafter needs the export module
    from tlt_rt.models.eagle_export import load_eagle

    return load_eagle(path, target)


# what the auto policy did, and what kept it from speculating: steps held back by the regret budget, second steps
# of tries that caught the drafter up, and the catch-up it priced per row
POLICY_KEYS = ("strategy_use", "measure_steps", "plain_timing_steps", "explore_steps", "switches", "held_back_steps",
               "follow_up_steps", "catchup_us_per_row")  # fmt: skip


def engine_row(eng: Engine, name: str, batch: int, timed: dict) -> dict:
    """One result row: the timing, the engine's step counts and the mean step ms per option it ran."""
    st = eng.stats()
    pol = eng.policy.stats()
    mean_ms = {}  # mean step ms per option over the engine's steps, what the policy weighed
    spent = dict.fromkeys(("prefill", "decode", "sd"), 0.0)  # seconds by kind of step, every call
    for e in eng.timeline:
        spent[e["kind"]] += e["seconds"]
        if e["kind"] != "prefill":
            mean_ms.setdefault(e["strategy"] or "off", []).append(1e3 * e["seconds"])
    stepped = sum(spent.values())
    # auto's dearest speculative steps of more than half the batch (the tail's small steps are cheap and
    # another bucket): what the bucket's regret budget saw (a catch-up, a compile, a rebuilt window)
    sd = [e for e in eng.timeline if e["kind"] == "sd" and 2 * e["batch"] > batch]
    dearest = sorted(sd, key=lambda e: e["seconds"], reverse=True)[:4] if name == "auto" else []
    return dict(
        provider="tlt",
        config=name,
        batch=batch,
        **timed,
        accept=st["mean_accept_length"],
        sd_steps=st["sd_steps"],
        steps=st["steps"],
        policy={k: pol[k] for k in POLICY_KEYS},
        step_ms={k: statistics.fmean(v) for k, v in mean_ms.items()},
        # where a call's stepped time goes: a short call at a large batch spends much of it prefilling
        time_share={k: v / stepped for k, v in spent.items()} if stepped else {},
        dearest_sd=[{k: e.get(k) for k in ("strategy", "batch", "seconds", "behind", "start")} for e in dearest],
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--strategies", nargs="+", default=["8_4_48", "8_4_16", "6_2_12"])
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--hf-prompts", type=int, default=4, help="prompts for transformers' generate (0: skip it)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per row (the median is reported)")
    ap.add_argument("--profile", type=int, default=0, help="print the N functions with the most host time per run")
    ap.add_argument("--kernels", type=int, default=0, help="print the N GPU kernels with the most time per step")
    ap.add_argument("--overlap-speculative", action=argparse.BooleanOptionalAction, default=True,
                    help="engines but the -serial ones also queue each speculative step while the host "
                    "postprocesses the one before (rollout.overlap_speculative, the default)")  # fmt: skip
    ap.add_argument("--configs", nargs="+", default=None,
                    help="rows to run: off, auto, strategies; off-serial, auto-serial: one step at a time")  # fmt: skip
    ap.add_argument("--interleave", action="store_true",
                    help="build every row's engine first, then time one call of each in turn per repeat")  # fmt: skip
    ap.add_argument("--learn-rounds", type=int, default=0,
                    help="with --interleave: untimed full calls of every engine before the timed rounds")  # fmt: skip
    ap.add_argument("--timeline", action="store_true",
                    help="with --interleave: print every timed call's steps as runs of one option")  # fmt: skip
    ap.add_argument("--max-prefill-tokens", type=int, default=0,
                    help="prompt tokens a prefill step takes (0: the engine's default)")  # fmt: skip
    ap.add_argument("--prefill-graph-tokens", type=int, default=-1,
                    help="every engine's rollout.prefill_graph_tokens (a lone prompt's prefill captured; -1: the "
                         "engine's default, 256 with graphs; 0: eager)")  # fmt: skip
    ap.add_argument("--target", default=None,
                    help="model folder, .gguf or registry name (default: the embedded SmolLM2)")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the timed calls (0: greedy, the default)")  # fmt: skip
    ap.add_argument("--task-config", default=None,
                    help="an RL config whose arithmetic task makes the prompts (default: 2-digit 2-step)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    global TEMPERATURE
    TEMPERATURE = args.temperature
    warnings.simplefilter("ignore")
    task = None
    if args.task_config:
        try:
            task = ArithmeticTask.from_config_file(args.task_config)
        except ValueError as e:
            ap.error(f"--task-config {e}")
    tok = load_tokenizer(args.target)
    target = load_target(args.target, dtype="bfloat16", device="cuda")  # one copy, shared by every engine
    rows = []
    for b in args.batch:
        prompts = prompts_for(b, tok, task)
        # room for each sequence's prompt, its answer and a speculative step's scratch: a bounded cache
        per_seq = -(-(max(len(p) for p in prompts) + args.max_new_tokens + 64) // 16)
        # *-serial: one step at a time (rollout.overlap=false), against plain steps queued ahead
        configs = [("off", "off", args.strategies), ("off-serial", "off", args.strategies)]
        configs += [(s, "on", [s]) for s in args.strategies]
        configs += [("auto", "auto", args.strategies), ("auto-serial", "auto", args.strategies)]
        chosen = args.configs or [c[0] for c in configs if not c[0].endswith("-serial")]
        configs = [c for c in configs if c[0] in chosen]
        engines = {}
        for name, mode, strategies in configs:
            engines[name] = Engine(
                target,
                drafter=load_drafter(args.drafter, target),
                speculative=mode,
                strategies=strategies,
                max_batch=max(b, 1),
                num_blocks=256 + per_seq * b,
                **({"max_prefill_tokens": args.max_prefill_tokens} if args.max_prefill_tokens else {}),
                prefill_graph_tokens=args.prefill_graph_tokens,
                overlap=not name.endswith("-serial"),
                overlap_speculative=args.overlap_speculative and not name.endswith("-serial"),
            )
            if args.interleave:
                continue
            tps, n, split = run_engine(
                engines[name], prompts, args.max_new_tokens, args.profile, args.repeats, args.kernels
            )
            rows.append(engine_row(engines.pop(name), name, b, dict(tokens_per_s=tps, tokens=n, call_ms=split)))
            gc.collect()
            torch.cuda.empty_cache()
        if args.interleave:
            timed = run_interleaved(engines, prompts, args.max_new_tokens, args.repeats, args.learn_rounds,
                                    args.timeline)  # fmt: skip
            rows += [engine_row(eng, name, b, timed[name]) for name, eng in engines.items()]
        del engines
        gc.collect()
        torch.cuda.empty_cache()
    hf_prompts = prompts_for(args.hf_prompts, tok, task)
    for lookup in (False, True) if args.hf_prompts else ():
        tps, n = run_hf(hf_prompts, args.max_new_tokens, lookup, args.target)
        rows.append(
            dict(
                provider="hf",
                config="prompt-lookup" if lookup else "generate",
                batch=1,
                tokens_per_s=tps,
                tokens=n,
                accept=None,
                sd_steps=0,
                steps=0,
            )
        )
    sampling = "greedy" if TEMPERATURE == 0 else f"T={TEMPERATURE:g}"
    print(f"device: {torch.cuda.get_device_name()}; target {args.target or 'SmolLM2-135M-Instruct'}, {sampling}, "
          f"max_new_tokens {args.max_new_tokens}")  # fmt: skip
    print("tok/s: median of the timed calls; accept and sd/steps: over every call of the engine (warm-up included)")
    print("x off: with --interleave the median over rounds of the ratio to off's call in the same round")
    print(f"{'provider':8} {'config':14} {'batch':>5} {'tok/s':>9} {'x off':>6} {'accept':>6} {'sd/steps':>9}")
    for r in rows:
        acc = f"{r['accept']:.2f}" if r["accept"] else "-"
        ratio = f"{r['paired_ratio']:.3f}" if r.get("paired_ratio") else "-"
        print(
            f"{r['provider']:8} {r['config']:14} {r['batch']:5d} {r['tokens_per_s']:9.1f} {ratio:>6} {acc:>6} "
            f"{r['sd_steps']:4d}/{r['steps']:<4d}"
        )
    print("step ms (mean over the engine's decode / SD steps), the share of stepped time in prefill / plain / SD")
    print("steps, and the auto policy's decisions:")
    for r in rows:
        if r["provider"] == "tlt":
            ms = ", ".join(f"{k} {v:.2f}" for k, v in r["step_ms"].items())
            ms += " | " + " / ".join(f"{100 * r['time_share'].get(k, 0):.0f}%" for k in ("prefill", "decode", "sd"))
            extra = f" | {r['policy']}" if r["config"] == "auto" else ""
            print(f"  {r['config']:8} b={r['batch']:<4d} {ms}{extra}")
    print("a timed call's ms (median over calls): prefill steps + plain steps + SD steps + other (between steps)")
    for r in rows:
        if r.get("call_ms"):
            c = r["call_ms"]
            parts = " + ".join(f"{k} {c[k]:.1f}" for k in ("prefill", "decode", "sd", "other"))
            print(f"  {r['config']:8} b={r['batch']:<4d} {sum(c.values()):7.1f} = {parts}")
    print("auto's dearest SD steps of over half the batch (strategy, batch, ms, drafter rows caught up eagerly):")
    for r in rows:
        if r.get("dearest_sd"):
            d = "; ".join(f"{e['strategy']} b={e['batch']} {1e3 * e['seconds']:.2f} ms, {e['behind']} rows"
                          for e in r["dearest_sd"])  # fmt: skip
            print(f"  b={r['batch']:<4d} {d}")
    for r in rows:
        for i, line in enumerate(r.get("stories") or []):
            print(f"  {r['config']:8} b={r['batch']:<4d} call {i}: {line}")
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
