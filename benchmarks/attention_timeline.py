"""Where decode attention's time goes inside a captured decode step, from time stamps its programs take.

    python benchmarks/attention_timeline.py --model qwen2.5-coder-1.5b --batch 1 --ctx 1024 --table 2624
    python benchmarks/attention_timeline.py --model qwen2.5-coder-0.5b --attn bn=32 w=2 --plot timeline.png

The step is the decode chain with PDL (`step_costs.py`'s `pdl` variant: every one-row kernel Triton's, launched with
programmatic dependent launch; random bf16 weights of the shape; a CUDA graph). Its fused rotary decode attention
(`kernels.decode_rope_attention`) runs with `PROBE` set: each program writes the GPU's global timer at six points
(`kernels.probe`). After a few replays the last one's stamps are read, and per layer (median over the layers, us):

    waited      placed -> past its wait: how early PDL placed the program (the kernel before still running)
    skew        the spread of the programs' release (the first to the last past its wait)
    q/k/v       past its wait -> this step's q/k/v rows read (the projection's output, from L2)
    attend      q/k/v read -> its chunk attended (first tile loaded before the wait, the products, the softmax)
    arrive      attended -> the merge count returned (partials written, an atomic at GPU scope)
    merge       the last program's count -> the split partials merged (read back, the output written)
    span        the first release -> the last merge: what attention adds to the step's chain
    rest        the last merge -> the next layer's attention released: o, norm + gate/up, down, norm + q/k/v

The step's time with and without the stamps is printed too (the stamps cost a few stores a program). `--plot`
draws one layer's programs as bars of their phases. `--attn KEY=VALUE` sets decode attention's launch meta
(bn block_n, w num_warps, s num_stages, sw split_waves) for the run; `--out` appends the summary as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("waited", "skew", "q/k/v", "attend", "arrive", "merge", "span", "rest")
META_KEYS = {"bn": "block_n", "w": "num_warps", "s": "num_stages", "sw": "split_waves"}


def layer_phases(stamps: torch.Tensor, next_release: int | None = None) -> dict[str, float]:
    """One launch's phases in us from its stamps [programs, >=6] (ns: placed, released, q/k/v read, attended,
    arrived, merged; merged 0 in programs that did not merge). `next_release`: the next layer's first release,
    for "rest". Medians over programs for the per-program phases; merge over the programs that merged."""
    s = stamps.to(torch.int64)
    placed, released, q_read, attended, arrived, merged = (s[:, i] for i in range(6))
    if (released == 0).any():
        raise ValueError("layer_phases: a program's stamps are missing (was the buffer zeroed before the replay?)")
    mergers = merged > 0
    first = int(released.min())
    end = int(merged[mergers].max()) if mergers.any() else int(attended.max())

    def med(t: torch.Tensor) -> float:
        return statistics.median(t.double().tolist()) / 1e3

    out = {
        "waited": med(released - placed),
        "skew": (int(released.max()) - first) / 1e3,
        "q/k/v": med(q_read - released),
        "attend": med(attended - q_read),
        "arrive": med(arrived - attended) if (arrived > 0).all() else float("nan"),
        "merge": med(merged[mergers] - arrived[mergers]) if mergers.any() else float("nan"),
        "span": (end - first) / 1e3,
        "rest": (next_release - end) / 1e3 if next_release is not None else float("nan"),
    }
    return out


def step_phases(launches: list[torch.Tensor]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(the medians over layers of `layer_phases`, each layer's) for one step's launches in order."""
    per_layer = []
    for i, st in enumerate(launches):
        nxt = int(launches[i + 1][:, 1].min()) if i + 1 < len(launches) else None
        per_layer.append(layer_phases(st, nxt))
    summary = {}
    for key in PHASES:
        vals = [p[key] for p in per_layer if p[key] == p[key]]  # NaN-free
        summary[key] = statistics.median(vals) if vals else float("nan")
    return summary, per_layer


def print_phases(summary: dict[str, float], title: str) -> None:
    print(title)
    print("  " + " ".join(f"{k:>8}" for k in PHASES))
    print("  " + " ".join(f"{summary[k]:8.2f}" for k in PHASES))


def plot_layer(stamps: torch.Tensor, out: str, title: str) -> None:
    """One layer's programs as horizontal bars: waiting, q/k/v, attend, arrive, merge (us from the first release)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = stamps.to(torch.int64)
    t0 = int(s[:, 1].min())
    colours = ("#c9c9c9", "#4c72b0", "#55a868", "#dd8452", "#c44e52")
    names = ("waiting (placed early)", "q/k/v read", "attend", "partials + count", "merge")
    fig, ax = plt.subplots(figsize=(8, 0.22 * len(s) + 1.6))
    for row, st in enumerate(s.tolist()):
        edges = [st[0], st[1], st[2], st[3], st[4], st[5] if st[5] else st[4]]
        for k in range(5):
            a, b = (edges[k] - t0) / 1e3, (edges[k + 1] - t0) / 1e3
            if b > a:
                ax.barh(row, b - a, left=a, color=colours[k], label=names[k] if row == 0 or k == 4 else None)
    handles, labels = ax.get_legend_handles_labels()
    keep = dict(zip(labels, handles, strict=True))
    ax.legend(keep.values(), keep.keys(), loc="lower right", fontsize=8)
    ax.axvline(0, color="k", lw=0.6)
    ax.set_xlabel("us from the first program's release")
    ax.set_ylabel("program (sequence x KV head x split)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="as step_costs.py --model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--table", type=int, default=0, help="as step_costs.py --table")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--attn", nargs="*", default=[], metavar="KEY=VALUE", help="bn, w, s, sw: DECODE_META's")
    ap.add_argument("--plot", default=None, help="a PNG of the middle layer's programs")
    ap.add_argument("--out", default=None, help="append the summary as a JSON line")
    args = ap.parse_args(argv)
    meta = {}
    for item in args.attn:
        key, _, value = item.partition("=")
        if key not in META_KEYS or not value.isdigit():
            ap.error(f"--attn {item!r}: expected one of {', '.join(k + '=N' for k in META_KEYS)}")
        meta[META_KEYS[key]] = int(value)
    if not torch.cuda.is_available():
        raise SystemExit("attention_timeline.py needs a CUDA GPU (the stamps are the GPU's timer)")
    from step_costs import VARIANTS, build_model, graphed_step, model_source, time_replays

    try:
        model_source(args.model)
    except ValueError as e:
        ap.error(str(e))
    from tlt_rt.codegen.backend import TritonAttention
    from tlt_rt.codegen.kernels import decode_rope_attention as rope_dec
    from tlt_rt.codegen.kernels import skinny_gemm
    from tlt_rt.codegen.kernels.probe import Stamps
    from tlt_rt.codegen.model_kernels import KernelGlue
    from tlt_rt.models.layers import set_glue

    rope_dec.DECODE_META = {**rope_dec.DECODE_META, **meta}
    model = build_model(args.model)
    skinny_gemm.MIN_WEIGHT = 0
    model.fuse_projections()
    base = model.compile_glue(KernelGlue())
    glue, attn = VARIANTS["pdl"]
    set_glue(model, KernelGlue(pieces=base, **glue))
    model.attn_backend = TritonAttention(**attn)
    layers = model.arch.num_hidden_layers
    plain, plain_held, _ = graphed_step(model, args.batch, args.ctx, table=args.table)  # held: what it reads
    stamps = Stamps("cuda")
    rope_dec.PROBE = stamps
    try:
        g, held, _ = graphed_step(model, args.batch, args.ctx, table=args.table)
    finally:
        rope_dec.PROBE = None
    times = {"plain": [], "stamped": []}
    for _ in range(3):  # interleaved rounds
        times["plain"].append(time_replays(plain, args.replays))
        times["stamped"].append(time_replays(g, args.replays))
    for _ in range(3):
        g.replay()
    stamps.buf.zero_()
    g.replay()
    torch.cuda.synchronize()
    launches = stamps.read()[-layers:]  # the captured step's (the warm-up forwards took slots before it)
    summary, per_layer = step_phases(launches)
    plain_ms, stamped_ms = (statistics.median(t) * 1e3 for t in (times["plain"], times["stamped"]))
    grid = launches[0].shape[0]
    print(
        f"{args.model}, batch {args.batch}, ctx {args.ctx}, table {args.table or 'as wide as the context'}, "
        f"decode attention {grid} programs a layer, meta {rope_dec.DECODE_META}, {torch.cuda.get_device_name()}"
    )
    print(f"step {plain_ms:.3f} ms without stamps, {stamped_ms:.3f} ms with them; {layers} layers, "
          f"{1e3 * plain_ms / layers:.1f} us a layer")  # fmt: skip
    print_phases(summary, "median over layers, us:")
    if args.plot:
        mid = launches[layers // 2]
        plot_layer(mid, args.plot, f"{args.model} decode attention, layer {layers // 2}, batch {args.batch}, ctx "
                                   f"{args.ctx} ({torch.cuda.get_device_name()})")  # fmt: skip
    if args.out:
        row = dict(model=args.model, batch=args.batch, ctx=args.ctx, table=args.table, programs=grid,
                   meta=rope_dec.DECODE_META, step_ms=plain_ms, stamped_ms=stamped_ms, phases_us=summary,
                   per_layer_us=per_layer, device=torch.cuda.get_device_name())  # fmt: skip
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    del g, held, plain, plain_held


if __name__ == "__main__":
    main()
