"""A decode step's attention with the rotary and K/V write inside (`kernels.decode_rope_attention`), as a one-row
step runs it: splits of the context and launch meta-parameters swept, on a GPU.

    python benchmarks/bench_rope_decode.py --shape qwen2.5-coder-1.5b --batch 1 --ctx 1024 [--table 4096]

Each setting is captured in one CUDA graph as LAYERS launches over as many layers' caches (so no layer's K/V is in
L2 from the one before, as in a step) and timed by graph replays; one launch = replay / LAYERS. --table is the block
table's width in positions (the engine's: its longest context; step_costs.py's: the context itself), from which the
default split count is chosen.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_costs import append_jsonl, time_replays  # noqa: E402

from tlt_rt.codegen.kernels import decode_attention, decode_rope_attention  # noqa: E402
from tlt_rt.models.shapes import SHAPES  # noqa: E402

PAGE = 16


def setup(shape: str, batch: int, ctx: int, table: int, layers: int):
    s = SHAPES[shape]
    hq, hkv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    per_seq = -(-table // PAGE)
    caches = [
        torch.randn(2, batch * per_seq + 1, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(layers)
    ]
    tables = torch.arange(batch * per_seq, device="cuda", dtype=torch.int32).view(batch, per_seq)
    qkv = torch.randn(batch, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    pos = torch.full((batch,), ctx, device="cuda")
    slots = tables[:, ctx // PAGE].long() * PAGE + ctx % PAGE
    lens = torch.full((batch,), ctx + 1, device="cuda", dtype=torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    return q, k, v, pos, inv, caches, slots, tables, lens, d**-0.5


def time_setting(args, inputs, splits, meta) -> float:
    """Seconds of one launch under `splits` (None: the default choice) and `meta`, over `setup`'s inputs."""
    q, k, v, pos, inv, caches, slots, tables, lens, scale = inputs
    saved = dict(decode_attention.DECODE_META)
    decode_rope_attention.DECODE_META.update(meta)  # the same dict object both modules read
    try:

        def run():
            for c in caches:
                decode_rope_attention.decode_rope_attention(q, k, v, pos, inv, c[0], c[1], slots, tables, lens, scale,
                                                            num_splits=splits)  # fmt: skip

        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        return time_replays(g, args.iters) / args.layers
    finally:
        decode_rope_attention.DECODE_META.clear()
        decode_rope_attention.DECODE_META.update(saved)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--table", type=int, default=None, help="block table width in positions (default: --ctx + 1)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32], help="0: the default choice")
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.table = args.table or args.ctx + 1
    inputs = setup(args.shape, args.batch, args.ctx, args.table, args.layers)  # the same for every setting
    rows = []
    for splits, bn, nw, ns in itertools.product(args.splits, args.block_n, args.warps, args.stages):
        meta = {"block_n": bn, "num_warps": nw, "num_stages": ns}
        try:
            us = time_setting(args, inputs, splits or None, meta) * 1e6
        except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit is reported and skipped
            print(f"splits {splits} {meta}: {type(e).__name__}: {str(e)[:100]}")
            continue
        rows.append(dict(shape=args.shape, batch=args.batch, ctx=args.ctx, table=args.table, splits=splits, **meta,
                         us=us, device=torch.cuda.get_device_name()))  # fmt: skip
    rows.sort(key=lambda r: r["us"])
    print(f"{args.shape} batch {args.batch} ctx {args.ctx} table {args.table}: us a launch (splits 0 = default)")
    for r in rows[:12]:
        print(f"{r['us']:7.2f}  splits {r['splits']:3d}  block_n {r['block_n']:3d}  warps {r['num_warps']}  "
              f"stages {r['num_stages']}")  # fmt: skip
    default = [r for r in rows if r["splits"] == 0 and r["block_n"] == 64 and r["num_warps"] == 4]
    if default:
        print(f"default settings: {min(r['us'] for r in default):.2f} us")
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
