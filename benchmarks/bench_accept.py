"""Tree acceptance: the Triton kernel (`tlt`) against the plain-torch reference (`torch`).

    pytest benchmarks/bench_accept.py --benchmark-only

B in {1, 16, 64}, T = 48 tree nodes, D = 8, V = 49152 on CUDA (V = 4096 and the reference only on a
CPU, where the kernel would run under the interpreter). Draft tokens are their parent's top-3 target
tokens, so walks go a level or more deep. Modes: all-greedy, sampled (no filter: no threshold sort),
sampled with top-p 0.9 (includes the sort pre-pass over all B*T rows). On CUDA, extra_info holds the
median / 20% / 80% quantiles in ms of triton.testing.do_bench (eager, launch overhead included) and of
do_bench_cudagraph (replayed in a CUDA graph), and the rate over the logits rows the kernel streams.
"""

from __future__ import annotations

import pytest
import torch

from tlt_rt.codegen.kernels.accept import accept_tree

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
T, D = 48, 8
V = 49152 if CUDA else 4096
MODES = {"greedy": (0.0, 1.0), "sampled": (1.0, 1.0), "top_p": (1.0, 0.9)}  # temperature, top_p


def _inputs(B: int, mode: str):
    g = torch.Generator().manual_seed(B)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(torch.bfloat16)
    parents = (torch.rand(B, T, generator=g) * torch.arange(T)).long()
    parents[:, 0] = -1
    top = logits.float().topk(3, dim=-1).indices  # [B, T, 3]
    pick = torch.randint(0, 3, (B, T, 1), generator=g)
    tokens = top.gather(1, parents.clamp_min(0)[..., None].expand_as(top)).gather(2, pick).squeeze(2)
    temp, top_p = MODES[mode]
    args = (
        logits,
        tokens,
        parents,
        torch.full((B,), temp),
        torch.full((B,), -1, dtype=torch.int32),
        torch.full((B,), top_p),
        torch.rand(B, D + 1, 2, generator=g),
    )
    return tuple(a.to(DEVICE) for a in args) + (D,)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("provider", ["tlt", "torch"])
def test_accept(benchmark, provider, B, mode):
    if provider == "tlt" and not CUDA:
        pytest.skip("the kernel is timed on CUDA only")
    args = _inputs(B, mode)
    kw = dict(
        all_greedy=mode == "greedy", filtering=mode == "top_p", backend="triton" if provider == "tlt" else "torch"
    )

    def step():
        out = accept_tree(*args, **kw)
        if CUDA:
            torch.cuda.synchronize()
        return out

    out = step()
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name() if CUDA else "cpu",
        B=B,
        T=T,
        V=V,
        D=D,
        mean_accept_len=float(out.accept_len.float().mean()),
    )
    if CUDA:
        import triton.testing

        def call():
            return accept_tree(*args, **kw)

        eager = triton.testing.do_bench(call, quantiles=[0.5, 0.2, 0.8])
        graph = triton.testing.do_bench_cudagraph(call, quantiles=[0.5, 0.2, 0.8])
        rows = float((out.accept_len + 1 + (mode != "greedy")).sum())  # logits rows the kernel streams
        benchmark.extra_info.update(
            eager_ms_median_q20_q80=eager, graph_ms_median_q20_q80=graph, rows_gbps=rows * V * 2 / graph[0] / 1e6
        )
    benchmark(step)
