"""One GPU report: step costs against the HBM floor, SD speedup per verify budget, adaptivity on a long-tail
rollout, and CUDA-graph pool memory. Writes DIR/report.md (a section for benchmarks/RESULTS.md) and PNG plots.

    python benchmarks/gpu_report.py --out DIR [--drafter DIR] [--sections roofline,strategies,adaptivity,memory]
    python benchmarks/gpu_report.py --out DIR --smoke    # CPU, tiny random models, every non-CUDA code path

Sections:
  roofline    decode and verify step time of SmolLM2 (bf16) and the Qwen2.5-7B shape (random bf16) against
              the HBM floor, via benchmarks/step_costs.py (one CUDA graph per shape, median of --iters).
  strategies  tokens/s of the engine with one SD strategy over tokens/s with SD off, on SmolLM2 with the given
              drafter, greedy, arithmetic prompts; plus a projection to the 7B shape:
              measured accept length x (7B engine decode step / 7B engine SD step, fresh 7B-shaped drafter).
  adaptivity  --requests rollouts with long-tail lengths. A short plain run gives the task's real response
              lengths; a lognormal fitted to them (sigma at least --min-sigma) gives each request a length,
              rounded up to one of --segments levels. SamplingParams is per call, so the rollout runs as
              segments: every request still running continues (its prompt + output so far, greedy, stop tokens
              off so that lengths are exact) for the tokens up to the next level. The running batch thus
              shrinks as in a real rollout, at the price of one re-prefill per segment boundary, paid equally
              by SD off, always-on (best strategy of the strategies section) and auto.
  memory      (CUDA only) graph pool bytes of one engine capturing every (bucket, strategy) into its one
              shared pool (whole decode steps, plain and speculative), against capturing each graph key into
              its own pool.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_costs  # noqa: E402

from tlt_rt.ir.strategy import scratch_tokens  # noqa: E402
from tlt_rt.models.arch import ArchConfig  # noqa: E402
from tlt_rt.models.attention import AttnMetadata  # noqa: E402
from tlt_rt.models.drafter import Drafter  # noqa: E402
from tlt_rt.models.llama import CausalLM  # noqa: E402
from tlt_rt.rollout import Engine, SamplingParams  # noqa: E402

SECTIONS = ("roofline", "strategies", "adaptivity", "memory")
REPO = Path(__file__).resolve().parent.parent
GPU_DEFAULTS = dict(
    models=["smollm2", "qwen2.5-7b"],
    batches=[1, 2, 4, 8, 16, 32, 64],
    contexts=[1024, 4096, 16384],
    roofline_verify=[16, 64],
    iters=10,
    strategies=["8_4_16", "8_4_32", "8_8_64"],
    strategy_batches=[1, 4, 16, 32],
    max_new_tokens=128,
    proj_ctx=1024,
    requests=128,
    probe_prompts=32,
    probe_max_new=512,
    segments=8,
    min_sigma=0.3,
    memory_max_batch=64,
)
SMOKE_DEFAULTS = dict(
    models=["tiny-smollm2", "tiny-7b"],
    batches=[1, 4],
    contexts=[32, 64],
    roofline_verify=[4],
    iters=2,
    strategies=["3_2_4", "4_2_8"],
    strategy_batches=[1, 3],
    max_new_tokens=6,
    proj_ctx=32,
    requests=8,
    probe_prompts=2,
    probe_max_new=8,
    segments=3,
    min_sigma=1.0,
    memory_max_batch=4,
)
_TINY = dict(vocab_size=49152, max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,))
TINY_SHAPES = {  # stand-ins with SmolLM2's vocabulary, so its tokenizer formats the prompts
    "tiny-smollm2": ArchConfig(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                               **_TINY),
    "tiny-7b": ArchConfig(model_type="qwen2", hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=2, head_dim=16, qkv_bias=True, **_TINY),
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ run state
@dataclass
class Report:
    """What every section shares: options, device, loaded models, measured step costs, output."""

    args: argparse.Namespace
    out: Path
    device: torch.device
    title: str
    models: dict[str, CausalLM] = field(default_factory=dict)
    costs: dict[tuple, float] = field(default_factory=dict)
    bandwidth: float = 0.0
    md: list[str] = field(default_factory=list)
    results: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def model(self, name: str) -> CausalLM:
        if name not in self.models:
            from tlt_rt.codegen.backend import select_backend
            from tlt_rt.codegen.model_kernels import engine_glue

            if name in TINY_SHAPES:
                torch.manual_seed(0)
                m = CausalLM(TINY_SHAPES[name]).to(self.device).eval()
            else:
                m = step_costs.build_model(name, str(self.device))
            m.attn_backend = select_backend(self.device)
            if self.cuda:
                engine_glue(m)  # time the step as the engine runs it
            self.models[name] = m
        return self.models[name]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def savefig(self, fig, name: str, heading: str) -> str:
        fig.suptitle(f"{heading}\n{self.title}", fontsize=9)
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=110)
        import matplotlib.pyplot as plt

        plt.close(fig)
        return name


def git_commit() -> str:
    """TLT_COMMIT when set (a copied tree's git metadata may be stale), else the checkout's HEAD."""
    if os.environ.get("TLT_COMMIT"):
        return os.environ["TLT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return (out.returncode == 0 and out.stdout.strip()) or "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU smoke ({platform.machine()}, {torch.get_num_threads()} threads)"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------ step costs
def cpu_bandwidth(nbytes: int = 64 << 20, iters: int = 5) -> float:
    """Bytes/s of a host tensor copy (read + write counted); the smoke mode's stand-in for HBM bandwidth."""
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def cpu_step_cost(model: CausalLM, batch: int, ctx: int, tree: int, block_size: int = 16, iters: int = 3) -> float:
    """Median seconds of one eager paged forward on the host, inputs laid out as in step_costs.step_cost."""
    per_seq = -(-(ctx + tree) // block_size)
    cache = model.make_cache(batch * per_seq + 1, block_size)
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    n = batch * tree
    pos = torch.arange(ctx, ctx + tree).repeat(batch)
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, ctx : ctx + tree]
    mode = "decode" if tree == 1 else "verify"
    mask = torch.ones(tree, tree, dtype=torch.bool).tril().expand(batch, tree, tree).contiguous()
    meta = AttnMetadata(
        mode,
        torch.arange(0, n + 1, tree, dtype=torch.int32),
        torch.full((batch,), ctx + tree, dtype=torch.int32),
        tables,
        slots.flatten().long(),
        tree,
        mask if mode == "verify" else None,
    )
    ids = torch.randint(0, model.arch.vocab_size, (n,))
    times = []
    with torch.no_grad():
        model.forward_paged(ids, pos, cache, meta)
        for _ in range(iters):
            t0 = time.perf_counter()
            model.forward_paged(ids, pos, cache, meta)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_seconds(rep: Report, name: str, batch: int, ctx: int, tree: int) -> float:
    """One step's median seconds (cached); NaN where the KV cache of the shape does not fit on the GPU."""
    key = (name, batch, ctx, tree)
    if key in rep.costs:
        return rep.costs[key]
    model = rep.model(name)
    if not rep.cuda:
        sec = cpu_step_cost(model, batch, ctx, tree, iters=rep.args.iters)
    else:
        a = model.arch
        kv = batch * (ctx + tree + 16) * a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 2
        if kv > 0.8 * torch.cuda.mem_get_info(rep.device)[0]:
            sec = math.nan
        else:
            try:
                sec = step_costs.step_cost(model, batch, ctx, tree, iters=rep.args.iters)
            except torch.OutOfMemoryError:
                sec = math.nan
                torch.cuda.empty_cache()
    rep.costs[key] = sec
    return sec


def fmt(x: float, spec: str = ".2f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


# ------------------------------------------------------------------------------------------------ roofline
def section_roofline(rep: Report) -> None:
    a = rep.args
    trees = [1, *a.roofline_verify]
    rows = []
    for name in a.models:
        model = rep.model(name)
        for ctx in a.contexts:
            for b in a.batches:
                for t in trees:
                    sec = step_seconds(rep, name, b, ctx, t)
                    fl = step_costs.floor_seconds(model, b, ctx, t, rep.bandwidth)
                    rows.append(dict(model=name, ctx=ctx, batch=b, tokens=t, ms=sec * 1e3, floor_ms=fl * 1e3))
    rep.results["roofline"] = rows
    plt = pyplot()
    fig, axes = plt.subplots(len(a.models), len(trees), figsize=(4.2 * len(trees), 3.4 * len(a.models)), squeeze=False)
    for i, name in enumerate(a.models):
        for j, t in enumerate(trees):
            ax = axes[i][j]
            for k, ctx in enumerate(a.contexts):
                sel = [r for r in rows if r["model"] == name and r["ctx"] == ctx and r["tokens"] == t]
                xs = [r["batch"] for r in sel]
                ax.plot(xs, [r["ms"] for r in sel], "o-", color=f"C{k}", label=f"ctx {ctx}")
                ax.plot(xs, [r["floor_ms"] for r in sel], "--", color=f"C{k}", label=f"floor ctx {ctx}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(a.batches, [str(b) for b in a.batches])
            ax.set_title(f"{name}: {'decode' if t == 1 else f'verify {t} tokens'}", fontsize=9)
            ax.set_xlabel("batch")
            ax.set_ylabel("ms / step")
            ax.legend(fontsize=6)
    png = rep.savefig(fig, "roofline.png", "Step time vs HBM floor (dashed)")
    head = " | ".join(["decode ms", *(f"verify {t} ms" for t in a.roofline_verify), "floor ms", "decode % floor"])
    md = [
        "### Step cost against the HBM floor",
        "",
        f"Median of {a.iters} {'CUDA-graph replays' if rep.cuda else 'eager host forwards'} per shape; floor ="
        f" (weights + KV read) / copy bandwidth {rep.bandwidth / 1e9:.0f} GB/s measured in this run. "
        "Shapes whose KV cache does not fit read n/a."
        + "".join(
            f" {n}: contexts past {rep.model(n).arch.max_position_embeddings} exceed its trained context (cost only)."
            for n in a.models
            if max(a.contexts) > rep.model(n).arch.max_position_embeddings
        ),
        "",
        f"| model | ctx | batch | {head} |",
        "|---|---:|---:|" + "---:|" * (3 + len(a.roofline_verify)),
    ]
    for name in a.models:
        for ctx in a.contexts:
            for b in a.batches:
                sel = {r["tokens"]: r for r in rows if (r["model"], r["ctx"], r["batch"]) == (name, ctx, b)}
                dec = sel[1]
                cells = [fmt(dec["ms"]), *(fmt(sel[t]["ms"]) for t in a.roofline_verify), fmt(dec["floor_ms"])]
                cells.append(fmt(100 * dec["floor_ms"] / dec["ms"], ".1f"))
                md.append(f"| {name} | {ctx} | {b} | " + " | ".join(cells) + " |")
    md += ["", f"![roofline]({png})", ""]
    rep.md += md


# ------------------------------------------------------------------------------------------------ engines
@dataclass
class EngineMaker:
    """Builds engines over one loaded target and drafter with a KV cache sized for the work, not the GPU."""

    target: CausalLM
    drafter: torch.nn.Module

    def __call__(self, mode: str, strategies: list[str], max_batch: int, max_len: int) -> Engine:
        scratch = max(scratch_tokens(_parse(s)) for s in strategies)
        per_seq = -(-(max_len + scratch + 1) // 16) + 1
        return Engine(
            self.target,
            drafter=None if mode == "off" else self.drafter,
            speculative=mode,
            strategies=strategies,
            max_batch=max_batch,
            num_blocks=max_batch * per_seq + 64,
        )


def fresh_drafter(target: CausalLM) -> torch.nn.Module:
    torch.manual_seed(0)
    return Drafter(target.arch, target).to(target.lm_head.weight.device, target.lm_head.weight.dtype).eval()


def engine_step_seconds(rep: Report, make: EngineMaker, batch: int, strategy: str | None) -> float:
    """Median seconds of one engine step on `make`'s target: plain decode (strategy None) or an SD step of
    `strategy`, at `batch` random prompts of --proj-ctx tokens, graphs captured first, stop tokens off so the
    batch stays full. Cached per (model, batch, strategy)."""
    key = ("engine", id(make.target), batch, strategy)
    if key in rep.costs:
        return rep.costs[key]
    ctx, new = rep.args.proj_ctx, 12
    strategies = [strategy] if strategy else rep.args.strategies
    eng = make("on" if strategy else "off", strategies, batch, ctx + new + 1)
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, make.target.arch.vocab_size, (batch, ctx), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=new, stop_token_ids=[])
    eng.capture([batch])
    eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2, stop_token_ids=[]))
    n0 = len(eng.timeline)
    eng.generate(prompts, params)
    kind = "sd" if strategy else "decode"
    secs = [e["seconds"] for e in eng.timeline[n0:] if e["kind"] == kind and e["batch"] == batch]
    rep.costs[key] = statistics.median(secs) if secs else math.nan
    del eng
    gc.collect()
    return rep.costs[key]


def _parse(s: str):
    from tlt_rt.ir.strategy import Strategy

    return Strategy.parse(s)


def engine_maker(rep: Report) -> EngineMaker:
    name = rep.args.models[0]
    target = rep.model(name)
    if rep.args.drafter:
        from tlt_rt.models.eagle_export import load_eagle

        drafter = load_eagle(rep.args.drafter, target)
    else:
        drafter = fresh_drafter(target)
    return EngineMaker(target, drafter)


def arithmetic_prompts(n: int) -> list[list[int]]:
    from tlt_rt.models.default import load_tokenizer
    from tlt_rt.train.rl.data import ArithmeticTask, format_prompt

    tok = load_tokenizer(None)
    return [format_prompt(p, tok) for p in ArithmeticTask(digits=2, num_ops=2, seed=1).sample(n)]


def timed_generate(rep: Report, engine: Engine, prompts, params: SamplingParams) -> tuple[float, int, list]:
    """(seconds, generated tokens, outputs) of one generate call."""
    rep.sync()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    rep.sync()
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs), outs


def warm_up(rep: Report, engine: Engine, prompts) -> None:
    engine.capture()
    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=min(8, rep.args.max_new_tokens)))


def accept_length(entries: list[dict]) -> float:
    """Tokens emitted per sequence per speculative step, over the given timeline entries."""
    sd = [e for e in entries if e["kind"] == "sd"]
    return sum(e["tokens"] for e in sd) / sum(e["batch"] for e in sd) if sd else math.nan


# ------------------------------------------------------------------------------------------------ strategies
def section_strategies(rep: Report, make: EngineMaker) -> None:
    a = rep.args
    bigs = a.models[1:] or a.models[:1]
    prompts = arithmetic_prompts(max(a.strategy_batches))
    max_len = max(len(p) for p in prompts) + a.max_new_tokens
    params = SamplingParams(temperature=0.0, max_new_tokens=a.max_new_tokens)
    tps: dict[tuple, float] = {}
    accept: dict[tuple, float] = {}
    for cfg in ["off", *a.strategies]:
        eng = make("off" if cfg == "off" else "on", a.strategies if cfg == "off" else [cfg],
                   max(a.strategy_batches), max_len)  # fmt: skip
        warm_up(rep, eng, prompts)
        for b in a.strategy_batches:
            n0 = len(eng.timeline)
            sec, n, _ = timed_generate(rep, eng, prompts[:b], params)
            tps[cfg, b] = n / sec
            accept[cfg, b] = accept_length(eng.timeline[n0:])
        del eng
        gc.collect()
    rows = [dict(batch=b, strategy=s, verify=_parse(s).verify_tokens, off_tps=tps["off", b], on_tps=tps[s, b],
                 speedup=tps[s, b] / tps["off", b], accept=accept[s, b])
            for b in a.strategy_batches for s in a.strategies]  # fmt: skip
    proj = []  # per (big model, batch, strategy): accept measured on the first model x big's step-cost ratio
    for big in bigs:
        big_make = EngineMaker(rep.model(big), fresh_drafter(rep.model(big)))
        for r in rows:
            dec = engine_step_seconds(rep, big_make, r["batch"], None)
            sd = engine_step_seconds(rep, big_make, r["batch"], r["strategy"])
            proj.append(dict(model=big, batch=r["batch"], strategy=r["strategy"], accept=r["accept"],
                             decode_s=dec, sd_s=sd, projected=r["accept"] * dec / sd))  # fmt: skip
        del big_make
        gc.collect()
    choices = {}  # what the cost model would pick at each (model, batch): the best projected rate, or off
    for big in bigs:
        for b in a.strategy_batches:
            sel = [p for p in proj if p["model"] == big and p["batch"] == b and math.isfinite(p["projected"])]
            top = max(sel, key=lambda p: p["projected"], default=None)
            choices[f"{big}@{b}"] = top["strategy"] if top and top["projected"] > 1.0 else "off"
            for q in sel:
                q["chosen"] = choices[f"{big}@{b}"] == q["strategy"]
    rep.results["strategies"] = rows
    rep.results["projections"] = proj
    rep.results["policy_choice"] = choices
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k, s in enumerate(a.strategies):
        sel = [r for r in rows if r["strategy"] == s]
        ax.plot([r["batch"] for r in sel], [r["speedup"] for r in sel], "o-", color=f"C{k}", label=f"{s} measured")
        for j, big in enumerate(bigs):
            sel = [p for p in proj if p["strategy"] == s and p["model"] == big]
            ax.plot([p["batch"] for p in sel], [p["projected"] for p in sel], "s^vD"[j % 4] + "--", color=f"C{k}",
                    label=f"{s} {big} proj.")  # fmt: skip
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(a.strategy_batches, [str(b) for b in a.strategy_batches])
    ax.set_xlabel("batch")
    ax.set_ylabel("speedup over SD off")
    ax.legend(fontsize=6)
    png = rep.savefig(
        fig, "strategies.png", f"SD speedup per verify budget ({a.models[0]}; dashed: projection to {', '.join(bigs)})"
    )
    drafter = a.drafter or "a freshly initialised drafter (accept length near 1: measures overhead, not gain)"
    rep.md += [
        "### Speculative speedup per verify budget",
        "",
        f"Target {a.models[0]}, drafter {drafter}; arithmetic prompts in the chat template, greedy, "
        f"{a.max_new_tokens} new tokens (stops at EOS). Measured speedup = tokens/s with the one strategy / "
        "tokens/s with SD off, same prompts.",
        "",
        "| batch | strategy | off tok/s | SD tok/s | measured speedup | accept length |",
        "|---:|---|---:|---:|---:|---:|",
        *(
            f"| {r['batch']} | {r['strategy']} | {r['off_tps']:.1f} | {r['on_tps']:.1f} | {r['speedup']:.2f} | "
            f"{fmt(r['accept'])} |"
            for r in rows
        ),
        "",
        f"**Projected** speedup on {', '.join(bigs)} = the accept length measured above x (engine decode step / "
        f"engine SD step of that strategy), both steps timed in the engine on that shape (random weights, fresh "
        f"drafter of that shape, prompts of {a.proj_ctx} tokens, median step), so the SD step includes drafting, "
        "verify, acceptance, KV commit and host work. A projection, not a measurement with a trained drafter of "
        "that size. *policy* marks what the cost model picks at that batch: the best projected rate, or SD off "
        "when none beats 1.",
        "",
        "| model | batch | strategy | decode ms | SD step ms | accept length | projected speedup | policy |",
        "|---|---:|---|---:|---:|---:|---:|---|",
        *(
            f"| {p['model']} | {p['batch']} | {p['strategy']} | {1e3 * p['decode_s']:.2f} | {1e3 * p['sd_s']:.2f} | "
            f"{fmt(p['accept'])} | {fmt(p['projected'])} (projection, {p['model']}) | "
            f"{'**chosen**' if p.get('chosen') else ''} |"
            for p in proj
        ),
        "",
        "Policy choice per batch (projection): " + "; ".join(f"{k}: {v}" for k, v in choices.items()),
        "",
        f"![strategies]({png})",
        "",
    ]


# ------------------------------------------------------------------------------------------------ adaptivity
def long_tail_lengths(real: list[int], n: int, cap: int, min_sigma: float, seed: int) -> tuple[list[int], float, float]:
    """n lengths drawn from a lognormal fitted to `real` (sigma floored), clipped to [2, cap]."""
    logs = [math.log(max(x, 1)) for x in real]
    mu = statistics.fmean(logs)
    sigma = max(statistics.pstdev(logs) if len(logs) > 1 else 0.0, min_sigma)
    rng = random.Random(seed)
    return [min(cap, max(2, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)], mu, sigma


def length_levels(lengths: list[int], segments: int) -> list[int]:
    """Up to `segments` ascending levels (quantiles of `lengths`, the maximum last)."""
    s = sorted(lengths)
    return sorted({s[min(len(s) - 1, math.ceil((k + 1) / segments * len(s)) - 1)] for k in range(segments)})


def segmented_rollout(rep: Report, engine: Engine, prompts, targets: list[int]) -> dict:
    """Run every request to its target length, level by level; returns seconds, tokens and the offset timeline."""
    levels = length_levels(targets, rep.args.segments)
    need = [next(lv for lv in levels if lv >= t) for t in targets]
    done = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    timeline, total, tokens, prev = [], 0.0, 0, 0
    for lv in levels:
        active = [i for i, t in enumerate(need) if t >= lv]
        params = SamplingParams(temperature=0.0, max_new_tokens=lv - prev, stop_token_ids=[])
        n0 = len(engine.timeline)
        sec, n, outs = timed_generate(rep, engine, [prompts[i] + outputs[i] for i in active], params)
        for e in engine.timeline[n0:]:
            timeline.append({**e, "start": e["start"] + total})
        for i, o in zip(active, outs, strict=True):
            outputs[i] += o.token_ids
            done[i] += len(o.token_ids)
        total += sec
        tokens += n
        prev = lv
    return dict(seconds=total, tokens=tokens, timeline=timeline, levels=levels, lengths=done)


def section_adaptivity(rep: Report, make: EngineMaker, best: str) -> None:
    a = rep.args
    prompts = arithmetic_prompts(max(a.requests, a.probe_prompts))
    probe = prompts[: a.probe_prompts]
    max_len = max(len(p) for p in prompts) + max(a.probe_max_new, 1)
    eng = make("off", a.strategies, max(len(probe), 1), max_len)
    _, _, outs = timed_generate(rep, eng, probe, SamplingParams(temperature=0.0, max_new_tokens=a.probe_max_new))
    real = [len(o.token_ids) for o in outs]
    del eng
    targets, mu, sigma = long_tail_lengths(real, a.requests, a.probe_max_new, a.min_sigma, a.seed)
    prompts = prompts[: a.requests]
    runs = {}
    for label, mode, strategies in [("off", "off", a.strategies), (f"on {best}", "on", [best]),
                                    ("auto", "auto", a.strategies)]:  # fmt: skip
        eng = make(mode, strategies, a.requests, max_len)
        warm_up(rep, eng, prompts)
        runs[label] = segmented_rollout(rep, eng, prompts, targets)
        line = runs[label]["timeline"]
        runs[label]["sd_steps"] = sum(e["kind"] == "sd" for e in line)
        runs[label]["steps"] = sum(e["kind"] != "prefill" for e in line)
        runs[label]["strategy_use"] = dict(Counter(e["strategy"] for e in line if e["kind"] == "sd"))
        del eng
        gc.collect()
    base = runs["off"]["seconds"]
    rep.results["adaptivity"] = dict(
        real_lengths=real, mu=mu, sigma=sigma, targets=targets,
        runs=runs,
    )  # fmt: skip
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=False)
    for k, (label, r) in enumerate(runs.items()):
        steps = [e for e in r["timeline"] if e["kind"] != "prefill"]
        ax1.step([e["start"] for e in steps], [e["running"] for e in steps], where="post", color=f"C{k}", label=label)
    ax1.set_ylabel("running batch")
    ax1.set_xlabel("seconds")
    ax1.legend(fontsize=7)
    auto = runs["auto"]["timeline"]
    cats = ["prefill", "decode", *a.strategies]
    for k, cat in enumerate(cats):
        sel = [e for e in auto if (e.get("strategy") or e["kind"]) == cat]
        ax2.broken_barh([(e["start"], max(e["seconds"], 1e-6)) for e in sel], (k - 0.4, 0.8), color=f"C{k}")
    ax2.set_yticks(range(len(cats)), cats)
    ax2.set_xlabel("seconds (auto run)")
    ax2.set_title("auto: step chosen over time", fontsize=9)
    png = rep.savefig(fig, "adaptivity.png", f"Long-tail rollout, {a.requests} requests ({a.models[0]})")
    rep.md += [
        "### Adaptivity on a long-tail rollout",
        "",
        f"{a.requests} arithmetic requests. A plain greedy run of {a.probe_prompts} prompts (cap {a.probe_max_new}) "
        f"gave response lengths median {statistics.median(real):.0f}, max {max(real)}; a lognormal "
        f"(mu {mu:.2f}, sigma {sigma:.2f}, floor {a.min_sigma}) gave lengths median {statistics.median(targets):.0f}"
        f", max {max(targets)}, rounded up to levels {runs['off']['levels']}. SamplingParams is per call, so "
        "the rollout runs level by level: every unfinished request continues from its prompt + output so far "
        "(greedy, stop tokens off so lengths are exact); each boundary re-prefills the survivors in every mode.",
        "",
        "| mode | seconds | tokens | tokens/s | speedup over off | SD steps / steps |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {label} | {r['seconds']:.2f} | {r['tokens']} | {r['tokens'] / r['seconds']:.1f} | "
            f"{base / r['seconds']:.2f} | {r['sd_steps']}/{r['steps']} |"
            for label, r in runs.items()
        ),
        "",
        f"auto's speculative steps per strategy: {runs['auto']['strategy_use'] or 'none'}.",
        "",
        f"![adaptivity]({png})",
        "",
    ]


# ------------------------------------------------------------------------------------------------ memory
def separate_pool_bytes(pool, keys) -> int:
    """Sum of pool bytes when each key is captured into its own GraphPool, freed before the next."""
    total = 0
    for key in keys:
        own = pool.fresh()
        own.capture([key])
        total += own.pool_bytes
        del own
        gc.collect()
        torch.cuda.empty_cache()
    return total


def section_memory(rep: Report) -> None:
    a = rep.args
    if not rep.cuda:
        rep.md += ["### CUDA-graph pool memory", "", "Skipped: CUDA graphs need a GPU (smoke run).", ""]
        return
    rows = []
    for name in a.models:
        target = rep.model(name)
        drafter = Drafter(target.arch, target).to(rep.device, target.lm_head.weight.dtype).eval()
        eng = Engine(target, drafter=drafter, speculative="auto", strategies=a.strategies,
                     max_batch=a.memory_max_batch, num_blocks=256)  # fmt: skip
        keys = eng.graph_keys()
        sep = separate_pool_bytes(eng.runner.pool, keys)
        shared = eng.capture()["pool_bytes"]
        graphs = len(keys)
        rows.append(dict(model=name, pool="target + draft", graphs=graphs, shared=shared, separate=sep))
        del eng, drafter
        gc.collect()
        torch.cuda.empty_cache()
    rep.results["memory"] = rows
    mib = 1 << 20
    rep.md += [
        "### CUDA-graph pool memory",
        "",
        f"Every (bucket up to {a.memory_max_batch}, strategy in {a.strategies}) graph of one engine captured into "
        "the engine's one shared pool (`engine.capture()`: whole decode steps, plain and speculative), against "
        "each graph key captured into its own pool "
        "(sum of pool bytes, freed between keys). Drafters are freshly initialised (memory does not depend on "
        "weights).",
        "",
        "| model | pool | graphs | shared pool MiB | sum of separate pools MiB | separate / shared |",
        "|---|---|---:|---:|---:|---:|",
        *(
            f"| {r['model']} | {r['pool']} | {r['graphs']} | {r['shared'] / mib:.1f} | {r['separate'] / mib:.1f} | "
            f"{fmt(r['separate'] / r['shared'] if r['shared'] else math.nan)} |"
            for r in rows
        ),
        "",
    ]


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder for report.md, results.json and the PNGs")
    ap.add_argument("--drafter", default=None, help="EAGLE drafter folder for the target (default: fresh one)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random models, small sizes")
    ints = {"iters", "max_new_tokens", "proj_ctx", "requests", "probe_prompts", "probe_max_new", "segments",
            "memory_max_batch"}  # fmt: skip
    for k, v in GPU_DEFAULTS.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, list):
            kind = str if isinstance(v[0], str) else int
            ap.add_argument(flag, nargs="+", type=kind, default=None, help=f"default {v} (smoke {SMOKE_DEFAULTS[k]})")
        else:
            ap.add_argument(flag, type=int if k in ints else float, default=None, help=f"default {v}")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for k, v in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown sections {bad}; choose from {list(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --smoke for the CPU smoke mode")
    device = torch.device("cuda" if not args.smoke else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date, commit, dev = datetime.date.today().isoformat(), git_commit(), device_name(device)
    rep = Report(args, out, device, f"{dev} · {date} · {commit}")
    rep.bandwidth = step_costs.hbm_bandwidth() if rep.cuda else cpu_bandwidth()
    versions = f"torch {torch.__version__}"
    if rep.cuda:
        import triton

        versions += f", triton {triton.__version__}"
    command = "python benchmarks/gpu_report.py " + " ".join(shlex.quote(x) for x in argv)
    t0 = time.perf_counter()
    make = engine_maker(rep) if {"strategies", "adaptivity"} & set(args.sections) else None
    best = args.strategies[0]
    for name in [s for s in SECTIONS if s in args.sections]:  # strategies picks adaptivity's best
        t1 = time.perf_counter()
        if name == "roofline":
            section_roofline(rep)
        elif name == "strategies":
            section_strategies(rep, make)
            rows = rep.results["strategies"]
            best = max(
                args.strategies, key=lambda s: statistics.fmean(r["speedup"] for r in rows if r["strategy"] == s)
            )
        elif name == "adaptivity":
            section_adaptivity(rep, make, best)
        else:
            section_memory(rep)
        rep.results.setdefault("section_seconds", {})[name] = time.perf_counter() - t1
        print(f"{name}: {time.perf_counter() - t1:.1f} s", flush=True)
    head = [
        f"## {date} — GPU report ({dev})" if rep.cuda else f"## {date} — gpu_report smoke run ({dev})",
        "",
        f"Command: `{command}` at commit `{commit}` ({versions}); {time.perf_counter() - t0:.0f} s.",
        "",
    ]
    if args.smoke:
        head += ["Smoke run: tiny random models on the host, timed with perf_counter; the numbers test the "
                 "script, they say nothing about the runtime.", ""]  # fmt: skip
    (out / "report.md").write_text("\n".join(head + rep.md))
    rep.results.update(command=command, device=dev, date=date, commit=commit)
    (out / "results.json").write_text(json.dumps(rep.results, indent=1, default=float))
    print(f"wrote {out / 'report.md'}")
    return out / "report.md"


if __name__ == "__main__":
    main()
