"""Token log-probs for the GRPO loss, forward + backward: full logits + token_logprobs (`dense`) against
chunked_token_logprobs (`chunked`), which never holds [N, V] logits.

    pytest benchmarks/bench_logprobs.py --benchmark-only        # pytest-benchmark (small sizes on a CPU)
    python benchmarks/bench_logprobs.py [--top-p 0.9] [--out rows.jsonl]   # markdown table, CUDA only

The script uses Qwen2.5-1.5B's head (H = 1536, V = 151936, bf16) with N in {4096, 16384} rows and chunks
of {1024, 2048, 4096} rows: median / 20% / 80% ms of triton.testing.do_bench over forward + backward
(gradients to the hidden rows and the head), and the peak memory above the inputs
(torch.cuda.max_memory_allocated after a reset; the head's and the rows' gradients are included).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tlt_rt.train.rl.grpo import token_logprobs
from tlt_rt.train.rl.logprobs import chunked_token_logprobs, kept_ids

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
H, V = 1536, 151936  # Qwen2.5-1.5B
MODES = {"plain": (1.0, -1, 1.0), "top_p": (0.7, -1, 0.9)}  # temperature, top_k, top_p


def make_case(n: int, h: int, v: int, dtype: torch.dtype, device: str, seed: int = 0):
    """hidden [n, h], head [v, h] (leaves), targets [n], upstream gradient [n]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 4 / h**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    grad = torch.randn(n, generator=g).to(device)
    return hidden, weight, targets, grad


def dense(hidden, weight, targets, temperature, top_k, top_p):
    """The learner's path: [N, V] logits, the sampler's kept set from them, token_logprobs."""
    logits = hidden @ weight.T
    keep = kept_ids(logits, temperature, top_k, top_p)
    return token_logprobs(logits, targets, temperature, keep)


def providers(case, mode: str, chunk: int) -> dict:
    hidden, weight, targets, grad = case
    temperature, top_k, top_p = MODES[mode]
    return {
        "dense": lambda: dense(hidden, weight, targets, temperature, top_k, top_p).backward(grad),
        "chunked": lambda: chunked_token_logprobs(
            hidden, weight, targets, temperature, top_k, top_p, chunk_tokens=chunk
        ).backward(grad),
    }


# ------------------------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("provider", ["dense", "chunked"])
def test_logprobs_fwd_bwd(benchmark, provider, mode):
    n, h, v, chunk = (4096, H, V, 1024) if CUDA else (512, 128, 16384, 128)
    dtype = torch.bfloat16 if CUDA else torch.float32
    case = make_case(n, h, v, dtype, DEVICE)
    fn = providers(case, mode, chunk)[provider]

    def step():
        case[0].grad = case[1].grad = None
        fn()
        if CUDA:
            torch.cuda.synchronize()

    benchmark.extra_info.update(
        device=torch.cuda.get_device_name() if CUDA else "cpu", N=n, H=h, V=v, chunk=chunk, dtype=str(dtype)
    )
    benchmark(step)


# ------------------------------------------------------------------------------------------ script
def _commit() -> str:
    """TLT_COMMIT when set (a copied tree's git metadata may be stale), else the checkout's HEAD."""
    if os.environ.get("TLT_COMMIT"):
        return os.environ["TLT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def measure(fn, leaves) -> tuple[list[float], float]:
    """(ms median / q20 / q80 of fn, peak GiB above what was allocated before it)."""
    import triton.testing

    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], grad_to_none=leaves)
    return ms, peak


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="append the rows as JSON lines")
    a = ap.parse_args(argv)
    if not CUDA:
        raise SystemExit("bench_logprobs.py's table needs a CUDA device (pytest mode runs on a CPU)")
    MODES["cli"] = (a.temperature, a.top_k, a.top_p)
    dev, date, commit = torch.cuda.get_device_name(), datetime.date.today().isoformat(), _commit()
    print(f"# bench_logprobs: {dev}, {date}, commit {commit}")
    print(f"# command: python benchmarks/bench_logprobs.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"# Qwen2.5-1.5B head H={H} V={V} bf16; temperature {a.temperature}, top_k {a.top_k}, top_p {a.top_p}")
    print("# forward + backward; ms median [q20, q80] of do_bench; peak GiB above the inputs\n")
    print("| N | provider | chunk | ms | [q20, q80] | peak GiB |")
    print("|---|---|---|---|---|---|")
    rows = []
    for n in a.rows:
        case = make_case(n, H, V, torch.bfloat16, "cuda")
        runs = [("dense", 0)] + [("chunked", c) for c in a.chunks]
        for name, chunk in runs:
            fn = providers(case, "cli", chunk or 1)[name]
            try:
                ms, peak = measure(fn, list(case[:2]))
                cells = f"{ms[0]:.2f} | [{ms[1]:.2f}, {ms[2]:.2f}] | {peak:.2f}"
            except torch.OutOfMemoryError:
                ms, peak, cells = None, None, "OOM | | OOM"
            torch.cuda.empty_cache()
            print(f"| {n} | {name} | {chunk or '-'} | {cells} |", flush=True)
            rows.append(
                dict(bench="logprobs", device=dev, date=date, commit=commit, N=n, H=H, V=V, provider=name,
                     chunk=chunk or None, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                     ms_median_q20_q80=ms, peak_gib=peak)
            )  # fmt: skip
        del case
        torch.cuda.empty_cache()
    if a.out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from step_costs import append_jsonl

        append_jsonl(a.out, rows)


if __name__ == "__main__":
    main()
