"""Decode-sized matmuls: cuBLAS (F.linear) against the skinny Triton kernel, as achieved HBM bandwidth.

    python benchmarks/bench_linear.py --model qwen2.5-7b --rows 1 2 4 8 [--tune]
    python benchmarks/bench_linear.py --model qwen2.5-coder-1.5b --rows 16 32 64 --tune --tune-rows 32 \
        --tune-block-n 16 32 64 128 --tune-block-k 64 128 256 --tune-stages 3 4 5   # tensor-core rows

For each weight shape of one decoder layer (fused q/k/v, o, fused gate/up, down) and the LM head, and each
row count, the matmul is captured REPEAT times in one CUDA graph over enough weight copies that no copy is
still in L2 when it is read again; the median replay time / REPEAT is one matmul. GB/s counts the weight
bytes only (activations are a few KB). --tune sweeps the kernel's launch meta-parameters and prints the
best per (rows, shape) next to the current defaults (from 9 rows of bf16 the kernel multiplies on tensor cores,
streaming W through shared memory: configs whose stages fit SHARED_BUDGET are tried).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_costs import append_jsonl, hbm_bandwidth, time_replays  # noqa: E402

from tlt_rt.codegen.kernels.skinny_gemm import (  # noqa: E402
    DOT_BF16,
    DOT_META,
    NARROW_N,
    ONE_ROW_NARROW,
    SKINNY_META,
    products,
    skinny_linear_triton,
)
from tlt_rt.models.shapes import SHAPES  # noqa: E402


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    s = SHAPES[name]
    h, d = s["hidden_size"], s["head_dim"]
    q, kv, i = s["num_attention_heads"] * d, s["num_key_value_heads"] * d, s["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (s["vocab_size"], h)}


SHARED_BUDGET = 200 << 10  # bytes of shared memory a tensor-core launch's pipeline stages may take (sm_90: 227 KB)


def fits(rows: int, cfg: dict) -> bool:
    """Whether --tune tries `cfg` for `rows` rows: CUDA-core products hold a [rows, BLOCK_N, BLOCK_K] product in
    registers (at most 32,768 elements); tensor-core ones (9+ rows of bf16) stage each of num_stages tiles of the rows
    and of W in shared memory."""
    bm = 1 << (rows - 1).bit_length()
    if products(bm, torch.bfloat16) >= DOT_BF16:
        return (bm + cfg["block_n"]) * cfg["block_k"] * 2 * cfg["num_stages"] <= SHARED_BUDGET
    return bm * cfg["block_n"] * cfg["block_k"] <= 32768


def time_op(fn, weights: list[torch.Tensor], x: torch.Tensor, repeat: int, iters: int = 15) -> float:
    """Seconds per call of fn(x, w), cycling through `weights` inside one captured graph."""
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(repeat):
            fn(x, weights[r % len(weights)])
    g.replay()
    torch.cuda.synchronize()
    sec = time_replays(g, iters)
    del g
    return sec / repeat


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="*", default=None, help="subset of qkv o gate_up down lm_head")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-rows", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--tune-block-n", type=int, nargs="+", default=[8, 16, 32], help="--tune's BLOCK_N values")
    ap.add_argument("--tune-block-k", type=int, nargs="+", default=[256, 512, 1024], help="--tune's BLOCK_K values")
    ap.add_argument("--tune-warps", type=int, nargs="+", default=[4, 8], help="--tune's num_warps values")
    ap.add_argument("--tune-stages", type=int, nargs="+", default=[2, 3, 4], help="--tune's num_stages values")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    bw = hbm_bandwidth()
    shapes = layer_shapes(a.model)
    if a.shapes:
        shapes = {k: shapes[k] for k in a.shapes}
    grid = [
        {"block_n": bn, "block_k": bk, "num_warps": nw, "num_stages": ns}
        for bn, bk, nw, ns in itertools.product(a.tune_block_n, a.tune_block_k, a.tune_warps, a.tune_stages)
    ]
    rows = []
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))  # > 5x a 50 MB L2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        repeat = max(copies, 8)
        for m in a.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0])
            got = skinny_linear_triton(x, weights[0])
            err = (got.float() - ref.float()).abs().max().item()
            t_cublas = time_op(lambda x, w: F.linear(x, w), weights, x, repeat)
            t_skinny = time_op(lambda x, w: skinny_linear_triton(x, w), weights, x, repeat)
            row = dict(
                model=a.model, shape=name, n=n, k=k, rows=m, cublas_us=t_cublas * 1e6, skinny_us=t_skinny * 1e6,
                cublas_pct=100 * nbytes / t_cublas / bw, skinny_pct=100 * nbytes / t_skinny / bw, max_err=err,
                device=torch.cuda.get_device_name(),
            )  # fmt: skip
            if a.tune and m in a.tune_rows:
                best = None
                for cfg in grid:
                    if not fits(m, cfg):
                        continue
                    if m > 8:  # tensor-core rows: W streamed in BLOCK_K tiles, as DOT_META
                        cfg = {**cfg, "whole": 0}
                    try:
                        t = time_op(lambda x, w, c=cfg: skinny_linear_triton(x, w, meta=c), weights, x, repeat, iters=5)
                    except Exception:  # noqa: BLE001 - a config that does not compile is skipped
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                row.update(tuned_us=best[0] * 1e6, tuned_pct=100 * nbytes / best[0] / bw, tuned=best[1])
            rows.append(row)
        del weights
        torch.cuda.empty_cache()
    print(f"HBM copy bandwidth {bw / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}; defaults {SKINNY_META}")
    print(f"one row against a weight of fewer than {NARROW_N} rows: {ONE_ROW_NARROW}; 9-64 rows: {DOT_META}")
    print(f"{'shape':8} {'N':>7} {'K':>6} {'rows':>4} {'cuBLAS us':>9} {'%bw':>5} {'skinny us':>9} {'%bw':>5}  tuned")
    for r in rows:
        tuned = f"{r['tuned_us']:8.1f} {r['tuned_pct']:5.1f} {r['tuned']}" if "tuned" in r else ""
        print(
            f"{r['shape']:8} {r['n']:7d} {r['k']:6d} {r['rows']:4d} {r['cublas_us']:9.1f} {r['cublas_pct']:5.1f} "
            f"{r['skinny_us']:9.1f} {r['skinny_pct']:5.1f}  {tuned}"
        )
    append_jsonl(a.out, rows)


if __name__ == "__main__":
    main()
