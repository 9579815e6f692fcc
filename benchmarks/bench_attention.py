"""Paged decode / tree-verify attention: Triton kernels (`tlt`) vs the torch reference (`torch`).

Shapes are Qwen2.5-7B attention (28 query heads, 4 KV heads, head dim 128, bf16, 16-token pages).
Achieved bandwidth = K/V bytes a step must read (every cached position once per KV head) / time; it is
compared with a measured device-to-device copy (read + write bytes / time) on the same GPU. Verify with
many tree tokens is compute-heavy, so its attention TFLOP/s (4 * rows * keys * head_dim) is shown too.
The script times CUDA-graph replays (as the engine runs these steps), so launch overhead is excluded;
the pytest-benchmark rounds are eager (launch + synchronize included: ~0.17 ms floor on an H100).

    pytest benchmarks/bench_attention.py --benchmark-only      # pytest-benchmark, CUDA only
    python benchmarks/bench_attention.py                       # markdown table for benchmarks/RESULTS.md
    python benchmarks/bench_attention.py --tune                # sweep the kernels' launch meta-parameters
    python benchmarks/bench_attention.py --tune --decode 1x1024 16x4096 --best-out best.json   # decode only
    python benchmarks/bench_attention.py --tune --shape qwen2.5-coder-1.5b --decode 1x1024 32x1024
        # another model's attention heads (tlt_rt/models/shapes.py)
    python benchmarks/bench_attention.py --tree-splits --shape qwen2.5-coder-1.5b --table 32768 2624 \
        --cases 1x128x32 1x1024x32 32x128x32 1x128x4
        # tree attention under an engine-wide block table: every split's partials written and merged
        # (tree_attention.EVERY_SPLIT) against the used splits' only, in interleaved rounds
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import subprocess
import sys

import pytest
import torch

from tlt_rt.codegen.kernels import decode_attention, tree_attention
from tlt_rt.codegen.kernels.decode_attention import paged_decode_attention
from tlt_rt.codegen.kernels.tree_attention import paged_tree_attention
from tlt_rt.models.attention import AttnMetadata, paged_attention_reference

N_HEADS, N_KV, HEAD_DIM, PAGE = 28, 4, 128, 16
DTYPE = torch.bfloat16
DECODE_SHAPES = [(1, 4096), (1, 32768), (8, 8192), (32, 4096), (64, 2048)]  # (batch, context)
TREE_SHAPES = [(1, 4096, 32), (1, 32768, 64), (4, 8192, 48), (16, 4096, 16), (64, 2048, 8)]  # (+ tree tokens)


def set_heads(shape: str) -> None:
    """Use the query heads, KV heads and head size of `shape` (a name of tlt_rt/models/shapes.py)."""
    from tlt_rt.models.shapes import SHAPES

    global N_HEADS, N_KV, HEAD_DIM
    s = SHAPES[shape]
    N_HEADS, N_KV = s["num_attention_heads"], s["num_key_value_heads"]
    HEAD_DIM = s.get("head_dim") or s["hidden_size"] // N_HEADS
    print(f"# attention heads of {shape}: {N_HEADS} query, {N_KV} KV, head size {HEAD_DIM}")


def make_case(batch: int, ctx: int, n_tree: int, device: str = "cuda", table: int = 0):
    """Every sequence holds `ctx` tokens (the last n_tree of them the tree) in a shuffled paged cache; `table`
    > ctx: block tables as wide as that many positions (an engine's, sized for its longest context), the
    columns past the sequence holding block 0."""
    blocks_per_seq = -(-ctx // PAGE)
    num_blocks = batch * blocks_per_seq
    k = torch.randn(num_blocks, PAGE, N_KV, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    if table > ctx:
        tables = torch.cat([tables, tables.new_zeros(batch, -(-table // PAGE) - blocks_per_seq)], 1)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch * n_tree, N_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * n_tree
    slots = torch.zeros(batch * n_tree, dtype=torch.long, device=device)
    if n_tree == 1:
        meta = AttnMetadata("decode", cu, seq_lens, tables, slots, 1)
    else:  # a chain (causal) mask: the kernel reads the same bytes and does the same math for any tree
        mask = torch.ones(n_tree, n_tree, dtype=torch.bool, device=device).tril()
        meta = AttnMetadata("verify", cu, seq_lens, tables, slots, n_tree, mask.expand(batch, -1, -1).contiguous())
    return q, k, v, meta


def providers(q, k, v, meta):
    scale = HEAD_DIM**-0.5
    if meta.mode == "decode":
        tlt = lambda: paged_decode_attention(q, k, v, meta.block_tables, meta.seq_lens, scale)  # noqa: E731
    else:
        tlt = lambda: paged_tree_attention(q, k, v, meta.block_tables, meta.seq_lens, meta.tree_mask, scale)  # noqa: E731
    ref = lambda: paged_attention_reference(q, k, v, meta, scale)  # noqa: E731
    return {"tlt": tlt, "torch": ref}


def kv_bytes(meta: AttnMetadata) -> int:
    return 2 * int(meta.seq_lens.sum()) * N_KV * HEAD_DIM * DTYPE.itemsize


def attention_flops(meta: AttnMetadata) -> int:
    """QK^T and PV over every (query row, key) pair, causal/tree masking ignored."""
    return 4 * meta.max_q_len * int(meta.seq_lens.sum()) * N_HEADS * HEAD_DIM


def time_ms(fn) -> float:
    """Median ms of CUDA-graph replays of fn (eager do_bench where capture fails)."""
    import triton.testing

    fn()  # compile outside the capture
    try:
        return triton.testing.do_bench_cudagraph(fn, quantiles=[0.5, 0.2, 0.8])[0]
    except RuntimeError:
        return triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])[0]


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth: (read + write bytes) / median time."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), quantiles=[0.5, 0.2, 0.8])[0]
    return 2 * nbytes / ms / 1e6


# ------------------------------------------------------------------------------------------ pytest-benchmark
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="attention benchmarks need a CUDA device")


def _run(benchmark, fn):
    fn()  # compile / warm up outside the timed rounds

    def step():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(step, rounds=20, warmup_rounds=3)


@needs_cuda
@pytest.mark.parametrize("provider", ["tlt", "torch"])
@pytest.mark.parametrize(("batch", "ctx"), DECODE_SHAPES)
def test_bench_decode(benchmark, provider, batch, ctx):
    q, k, v, meta = make_case(batch, ctx, 1)
    benchmark.extra_info["kv_bytes"] = kv_bytes(meta)
    _run(benchmark, providers(q, k, v, meta)[provider])


@needs_cuda
@pytest.mark.parametrize("provider", ["tlt", "torch"])
@pytest.mark.parametrize(("batch", "ctx", "n_tree"), TREE_SHAPES)
def test_bench_tree(benchmark, provider, batch, ctx, n_tree):
    q, k, v, meta = make_case(batch, ctx, n_tree)
    benchmark.extra_info["kv_bytes"] = kv_bytes(meta)
    _run(benchmark, providers(q, k, v, meta)[provider])


# ------------------------------------------------------------------------------------------ script
def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    if "--tune" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--tune", action="store_true")
        ap.add_argument("--decode", nargs="+", default=None, help="decode cases BATCHxCONTEXT only")
        ap.add_argument("--best-out", default=None, help="write the best decode meta-parameters as JSON")
        ap.add_argument("--shape", default=None, help="the attention heads of this model shape (default Qwen2.5-7B)")
        args = ap.parse_args()
        if args.shape:
            set_heads(args.shape)
        cases = None if args.decode is None else [(*map(int, c.split("x")), 1) for c in args.decode]
        return tune(cases, args.best_out)
    if "--tree-splits" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--tree-splits", action="store_true")
        ap.add_argument("--shape", default=None, help="the attention heads of this model shape (default Qwen2.5-7B)")
        ap.add_argument("--table", type=int, nargs="+", default=[32768, 2624], help="block-table widths, positions")
        ap.add_argument("--cases", nargs="+", default=["1x128x32", "1x1024x32", "32x128x32", "1x128x4"],
                        help="BATCHxCONTEXTxTREE (context counts the tree tokens)")  # fmt: skip
        ap.add_argument("--rounds", type=int, default=7)
        args = ap.parse_args()
        if args.shape:
            set_heads(args.shape)
        return tree_splits([tuple(map(int, c.split("x"))) for c in args.cases], args.table, args.rounds)
    copy_gbs = copy_bandwidth_gbs()
    print(f"# bench_attention: {torch.cuda.get_device_name()}, {datetime.date.today()}, commit {_commit()}")
    print(f"# command: python benchmarks/bench_attention.py; Qwen2.5-7B attention, {DTYPE}, page {PAGE}")
    print(f"# device-to-device copy: {copy_gbs:.0f} GB/s; times are medians of CUDA-graph replays\n")
    print("| mode | batch | context | tree | tlt ms | torch ms | speedup | tlt GB/s | % of copy | tlt TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = [(b, c, 1) for b, c in DECODE_SHAPES] + list(TREE_SHAPES)
    for batch, ctx, n_tree in cases:
        q, k, v, meta = make_case(batch, ctx, n_tree)
        ms = {}
        for name, fn in providers(q, k, v, meta).items():
            try:
                ms[name] = time_ms(fn)
            except torch.OutOfMemoryError:
                ms[name] = float("nan")
            torch.cuda.empty_cache()
        gbs = kv_bytes(meta) / ms["tlt"] / 1e6
        tflops = attention_flops(meta) / ms["tlt"] / 1e9
        print(f"| {meta.mode} | {batch} | {ctx} | {n_tree} | {ms['tlt']:.3f} | {ms['torch']:.3f} | "
              f"{ms['torch'] / ms['tlt']:.1f}x | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {tflops:.0f} |")  # fmt: skip
        del q, k, v, meta
        torch.cuda.empty_cache()


def tree_splits(cases: list[tuple[int, int, int]], tables: list[int], rounds: int = 7) -> None:
    """Tree attention with every split's partials written and merged (`tree_attention.EVERY_SPLIT`) against the
    used splits' only, per (batch, context, tree tokens) case and block-table width: medians of `rounds`
    interleaved CUDA-graph timings, and whether the two outputs are bitwise equal."""
    copy_gbs = copy_bandwidth_gbs()
    print(f"# bench_attention --tree-splits: {torch.cuda.get_device_name()}, {datetime.date.today()}, commit "
          f"{_commit()}; {N_HEADS} query / {N_KV} KV heads of size {HEAD_DIM}, {DTYPE}, page {PAGE}; "
          f"copy {copy_gbs:.0f} GB/s; medians of {rounds} interleaved rounds\n")  # fmt: skip
    print("| batch | context | tree | table | splits | every split ms | used splits ms | x | equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    default = tree_attention.EVERY_SPLIT
    try:
        for (batch, ctx, n_tree), table in itertools.product(cases, tables):
            q, k, v, meta = make_case(batch, ctx, n_tree, table=table)
            fn = providers(q, k, v, meta)["tlt"]
            times: dict[bool, list[float]] = {True: [], False: []}
            outs = {}
            for _ in range(rounds):
                for every in (True, False):
                    tree_attention.EVERY_SPLIT = every
                    times[every].append(time_ms(fn))
                    outs[every] = fn()
            every_ms, used_ms = (statistics.median(times[e]) for e in (True, False))
            positions = meta.block_tables.shape[1] * PAGE
            splits = tree_attention.tree_tiling(batch, n_tree, n_tree, N_HEADS, N_KV, HEAD_DIM, positions, q.device)[3]
            equal = "yes" if torch.equal(outs[True], outs[False]) else "NO"
            print(f"| {batch} | {ctx} | {n_tree} | {table} | {splits} | {every_ms:.4f} | {used_ms:.4f} | "
                  f"{every_ms / used_ms:.2f}x | {equal} |", flush=True)  # fmt: skip
            del q, k, v, meta, fn, outs
            torch.cuda.empty_cache()
    finally:
        tree_attention.EVERY_SPLIT = default


def tune(decode_cases: list[tuple[int, int, int]] | None = None, best_out: str | None = None) -> None:
    """Sweep DECODE_META / TREE_META on a few shapes; prints ms per config, best first. With `decode_cases`
    only decode is swept, on those (batch, context, 1) cases; `best_out` receives the best decode config."""
    decode_grid = dict(block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3], split_waves=[1, 2, 4])
    sweeps = [(decode_attention.DECODE_META, decode_cases or [(1, 32768, 1), (8, 8192, 1), (64, 2048, 1)],
               decode_grid)]  # fmt: skip
    if decode_cases is None:
        sweeps.append((tree_attention.TREE_META, [(1, 32768, 64), (4, 8192, 48), (64, 2048, 8)],
                       dict(block_m=[64, 128], block_n=[32, 64], num_warps=[4, 8], num_stages=[2, 3],
                            split_waves=[1, 2])))  # fmt: skip
    for table, cases, grid in sweeps:
        default = dict(table)
        made = [(c, make_case(*c)) for c in cases]
        results = []
        for values in itertools.product(*grid.values()):
            table.update(zip(grid, values, strict=True))
            try:
                times = [time_ms(providers(*case)["tlt"]) for _, case in made]
            except Exception as err:  # a config that does not compile (shared memory) is skipped
                print(f"skip {dict(table)}: {type(err).__name__}")
                continue
            results.append((sum(times), times, dict(table)))
        table.clear()
        table.update(default)
        results.sort(key=lambda r: r[0])
        print(f"\n# {[c for c, _ in made]} (ms each), {N_HEADS}/{N_KV} heads x {HEAD_DIM}, default {default}")
        for total, times, cfg in results[:8]:
            print(f"{total:.3f}  {[round(t, 3) for t in times]}  {cfg}")
        if best_out and table is decode_attention.DECODE_META and results:
            with open(best_out, "w") as f:
                json.dump(results[0][2], f)
        del made
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
