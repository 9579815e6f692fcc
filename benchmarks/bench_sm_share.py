"""How much a training loop beside it slows a latency-bound CUDA graph, by the SMs the trainer may use (GPU).

    python benchmarks/bench_sm_share.py [--sms 0 16 32 64] [--replays 300]

The graph stands for a small-batch decode step: 100 dependent [8, 576] x [576, 576] matmuls with SiLU, on a
high-priority stream (as the engine's). The trainer stands for a drafter step's head: a [4096, 576] x
[576, 49152] bf16 GEMM, log-softmax and backward, back to back in a thread on `tail.trainer_stream(sms)`
(0 = every SM, on an ordinary stream; N = a green context of N SMs). Prints the graph's median replay time
alone and beside each trainer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tlt_rt.train.drafter.tail import trainer_stream  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, nargs="+", default=[0, 16, 32, 64])
    ap.add_argument("--replays", type=int, default=300)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    engine = torch.cuda.Stream(priority=-1)
    x = torch.randn(8, 576, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(576, 576, device=dev, dtype=torch.bfloat16) / 24 for _ in range(100)]

    def small():
        y = x
        for w in ws:
            y = torch.nn.functional.silu(y @ w)
        return y

    with torch.cuda.stream(engine):
        small()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=engine):
        small()

    def replay_ms() -> float:
        ts = []
        with torch.cuda.stream(engine):
            for _ in range(args.replays):
                t0 = time.perf_counter()
                graph.replay()
                engine.synchronize()
                ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)

    a = torch.randn(4096, 576, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(576, 49152, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def train(stream, stop: threading.Event, steps: list[int]) -> None:
        with torch.cuda.stream(stream):
            while not stop.is_set():
                torch.log_softmax((a @ w).float(), -1).mean().backward()
                stream.synchronize()
                steps[0] += 1

    alone = replay_ms()
    print(f"device: {torch.cuda.get_device_name()}; graph of 100 small matmuls, median replay ms")
    print(f"alone: {alone:.3f}")
    for sms in args.sms:
        stream, n = trainer_stream(dev, sms)
        stop, steps = threading.Event(), [0]
        thread = threading.Thread(target=train, args=(stream, stop, steps), daemon=True)
        thread.start()
        time.sleep(0.3)
        t0, s0 = time.perf_counter(), steps[0]
        ms = replay_ms()
        rate = (steps[0] - s0) / (time.perf_counter() - t0)
        stop.set()
        thread.join()
        print(f"trainer on {n or 'all'} SMs: {ms:.3f} ({ms / alone:.2f}x alone); trainer {rate:.0f} steps/s")


if __name__ == "__main__":
    main()
