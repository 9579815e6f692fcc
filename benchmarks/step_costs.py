"""Decode and verify step costs against the HBM floor, on a GPU.

    python benchmarks/step_costs.py --model qwen2.5-7b --batch 1 4 16 64 --ctx 1024 8192 --verify 16 48

For each (batch, context, mode) one paged forward is captured as a CUDA graph and its replays are timed
with CUDA events (median of --iters). The floor of a step is (weight bytes + KV bytes read) / the HBM
bandwidth measured in the same run by a large device-to-device copy. Models of known shapes are built with
random bf16 weights (nothing is downloaded); "smollm2" loads the embedded default model.
Prints a table and, with --out, appends JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import CausalLM
from tlt_rt.models.shapes import SHAPES


def build_model(name: str, device: str = "cuda") -> CausalLM:
    if name == "smollm2":
        from tlt_rt.models import load_target

        return load_target(None, dtype="bfloat16", device=device)
    arch = ArchConfig(**SHAPES[name])
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to_empty(device=device).to(torch.bfloat16)
    from tlt_rt.models.llama import Rotary

    model.rotary = Rotary(arch).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def hbm_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def graphed_step(model: CausalLM, batch: int, ctx: int, tree: int = 1, block_size: int = 16):
    """One paged forward captured as a CUDA graph: decode (tree=1) or a verify of `tree` tokens per sequence
    after `ctx` cached ones. Returns (graph, cache); the cache must live as long as the graph is replayed."""
    dev = model.lm_head.weight.device
    per_seq = -(-(ctx + tree) // block_size)
    cache = model.make_cache(batch * per_seq + 1, block_size)
    tables = torch.arange(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq)
    n = batch * tree
    pos = torch.arange(ctx, ctx + tree, device=dev).repeat(batch)
    slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=dev)).flatten(1)[:, ctx : ctx + tree]
    mode = "decode" if tree == 1 else "verify"
    mask = torch.ones(tree, tree, dtype=torch.bool, device=dev).tril().expand(batch, tree, tree).contiguous()
    meta = AttnMetadata(
        mode,
        torch.arange(0, n + 1, tree, dtype=torch.int32, device=dev),
        torch.full((batch,), ctx + tree, dtype=torch.int32, device=dev),
        tables,
        slots.flatten().long(),
        tree,
        mask if mode == "verify" else None,
    )
    ids = torch.randint(0, model.arch.vocab_size, (n,), device=dev)
    with torch.no_grad():
        for _ in range(2):
            model.forward_paged(ids, pos, cache, meta)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model.forward_paged(ids, pos, cache, meta)
    return g, cache


def step_cost(model: CausalLM, batch: int, ctx: int, tree: int, block_size: int = 16, iters: int = 30) -> float:
    """Median seconds of one graphed paged forward: decode (tree=1) or a verify of `tree` tokens."""
    g, cache = graphed_step(model, batch, ctx, tree, block_size)
    sec = time_replays(g, iters)
    del g, cache
    torch.cuda.empty_cache()
    return sec


def time_replays(g: torch.cuda.CUDAGraph, iters: int) -> float:
    """Median seconds of one replay of `g` over `iters` replays, each timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def append_jsonl(path: str | None, rows: list[dict]) -> None:
    """Append `rows` to the JSON-lines file at `path` (nothing when path is None)."""
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def kernel_table(prof, per: int) -> list[tuple[str, float, float]]:
    """(kernel name, us, launches) per `per` units (steps, replays) from a finished torch profiler, by time."""
    rows: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name, [0.0, 0.0])
            r[0] += e.device_time / per
            r[1] += 1 / per
    return sorted(((k, us, n) for k, (us, n) in rows.items()), key=lambda r: -r[1])


def print_kernel_table(rows: list[tuple[str, float, float]], title: str, top: int = 14) -> None:
    total, launches = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{title}: {total / 1e3:.3f} ms of kernels, {launches:.0f} launches")
    for name, us, n in rows[:top]:
        print(f"  {us:9.1f} us {n:6.1f}x  {name[:100]}")


def print_breakdown(model: CausalLM, batch: int, ctx: int, replays: int = 20, top: int = 14) -> None:
    """Kernel time per decode step by kernel name (torch profiler over graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    g, cache = graphed_step(model, batch, ctx)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    print_kernel_table(kernel_table(prof, replays), f"kernel breakdown, batch {batch} ctx {ctx}, per step", top)
    del g, cache
    torch.cuda.empty_cache()


def floor_seconds(model: CausalLM, batch: int, ctx: int, tree: int, bandwidth: float) -> float:
    a = model.arch
    # every weight is read once per step, except the embedding table (only the looked-up rows)
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or a.tie_word_embeddings)
    kv = batch * (ctx + tree) * a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 2
    return (weights + kv) / bandwidth


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b", choices=["smollm2", *SHAPES])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--verify", type=int, nargs="*", default=[16, 48])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--eager-glue", action="store_true", help="plain-torch norms/rotary/activation, as before fusion")
    ap.add_argument("--unfused", action="store_true", help="separate q/k/v and gate/up matmuls")
    ap.add_argument("--skinny", action="store_true", help="one-row matmuls of large weights through the Triton kernel")
    ap.add_argument("--no-fused-rope", action="store_true", help="rotary and the KV write as separate kernels")
    ap.add_argument("--separate-merge", action="store_true", help="split-K partials merged by a second kernel")
    ap.add_argument("--decode-meta", default=None, help="JSON file of decode attention meta-parameters to use")
    ap.add_argument("--profile", action="store_true", help="kernel time breakdown of the first decode shape")
    ap.add_argument("--label", default="", help="tag written into each row (variant under test)")
    args = ap.parse_args(argv)
    from tlt_rt.codegen.backend import select_backend

    if args.decode_meta:  # e.g. the best of `bench_attention.py --tune --best-out`
        from tlt_rt.codegen.kernels import decode_attention

        with open(args.decode_meta) as f:
            decode_attention.DECODE_META.update(json.load(f))
        print(f"decode meta-parameters: {decode_attention.DECODE_META}")
    if args.separate_merge:
        from tlt_rt.codegen.kernels import decode_attention

        decode_attention.split_counters = lambda device, n: None  # the launchers then merge in a second kernel
    bw = hbm_bandwidth()
    model = build_model(args.model)
    model.attn_backend = select_backend("cuda")
    if not args.eager_glue:  # the fused RMSNorm / rotary / SwiGLU the engine runs with on CUDA
        from tlt_rt.models.llama import CompiledGlue

        model.compile_glue(CompiledGlue(skinny=args.skinny, fused_rope=not args.no_fused_rope))
    if not args.unfused:
        model.fuse_projections()
    if args.profile:
        print_breakdown(model, args.batch[0], args.ctx[0])
    rows = []
    for ctx in args.ctx:
        for b in args.batch:
            for t in [1, *args.verify]:
                t0 = time.perf_counter()
                sec = step_cost(model, b, ctx, t, iters=args.iters)
                fl = floor_seconds(model, b, ctx, t, bw)
                rows.append(
                    dict(
                        model=args.model,
                        label=args.label,
                        batch=b,
                        ctx=ctx,
                        tokens=t,
                        ms=sec * 1e3,
                        floor_ms=fl * 1e3,
                        pct_floor=100 * fl / sec,
                        hbm_gbs=bw / 1e9,
                        device=torch.cuda.get_device_name(),
                        wall=time.perf_counter() - t0,
                    )
                )
    print(f"HBM copy bandwidth: {bw / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}")
    print(f"{'model':12} {'batch':>5} {'ctx':>6} {'tokens':>6} {'ms':>8} {'floor ms':>8} {'% floor':>7}")
    for r in rows:
        print(
            f"{r['model']:12} {r['batch']:5d} {r['ctx']:6d} {r['tokens']:6d} {r['ms']:8.3f} {r['floor_ms']:8.3f} "
            f"{r['pct_floor']:7.1f}"
        )
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
