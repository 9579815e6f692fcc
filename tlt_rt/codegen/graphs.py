"""CUDA-graph pool: one captured program per static shape key, all sharing one memory pool.

A key is (kind, batch bucket, ...); its kind names the `Program` that captures it. The engine registers
one kind, "step" (rollout/step/graph.py): a whole decode step, plain or speculative, per (bucket, option,
acceptance mode). Graphs are captured largest batch first so that smaller ones reuse the pool's blocks;
inputs live in static buffers that a replay fills (padding rows write nowhere), and prefill and anything
larger than the biggest bucket run eagerly.

Sharing one pool means a graph's intermediates may sit where another graph's outputs were allocated if
that graph was captured later. The forward's outputs are the graph's own tensors and are read before any
other graph of the pool replays; a program whose outputs must outlive another replay (the draft tree is
read after the verify replay) copies them into buffers allocated outside the pool.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Key = tuple  # (kind: str, batch: int, ...)


class Program(Protocol):
    """What the pool captures for one kind of key."""

    def static_inputs(self, key: Key) -> dict[str, torch.Tensor]:
        """The key's input buffers, allocated outside the pool, holding harmless padding values."""

    def run(self, key: Key, ins: dict[str, torch.Tensor]) -> Any:
        """The work to capture: reads only `ins` (and model state), no host sync, no data-dependent shape."""

    def fill(self, key: Key, ins: dict[str, torch.Tensor], *args) -> None:
        """Copy one call's arguments into `ins`, padding the batch up to the bucket."""

    def result(self, key: Key, outputs: Any, *args) -> Any:
        """The call's share of the graph's outputs (the batch's rows)."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: Any


class GraphPool:
    """Captures programs per key into one shared memory pool; replays with padding."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.programs: dict[str, Program] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Key, _Captured] = {}
        self.pool_bytes = 0

    def register(self, kinds: tuple[str, ...], program: Program) -> None:
        for kind in kinds:
            self.programs[kind] = program

    def fresh(self) -> GraphPool:
        """An empty pool with the same programs (to measure a key captured on its own)."""
        other = GraphPool(self.device)
        other.programs = dict(self.programs)
        return other

    def capture(self, keys: list[Key]) -> None:
        """Capture every key, largest batch first, into the shared pool."""
        before = self._reserved()
        for key in sorted(keys, key=lambda k: (-k[1], k)):
            if key in self.graphs:
                continue
            program = self.programs[key[0]]
            ins = program.static_inputs(key)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(2):  # warm-up compiles kernels outside the graph
                    program.run(key, ins)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a drafter trainer running in another thread (spot training during the tail) may
            # allocate and launch on its own stream while this thread captures
            with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                outs = program.run(key, ins)
            self.graphs[key] = _Captured(graph, ins, outs)
        self.pool_bytes += self._reserved() - before

    def _reserved(self) -> int:
        """Memory the allocator holds once its free cache is returned. Entering a capture empties that cache,
        so only readings taken after emptying it compare: their difference is what the graphs keep (the pool
        and the static inputs), not the warm-up runs' transient blocks. Unreachable Python objects are
        collected first: a collection that ran mid-capture and freed an earlier engine's KV cache made the
        difference negative (-2.5 GB in a test process)."""
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def has(self, key: Key) -> bool:
        return key in self.graphs

    def drop(self, keys: list[Key]) -> None:
        """Forget these keys' graphs (their memory goes back to the pool); a later replay captures them anew.

        The allocator counts the graphs that hold a private pool and releases the pool when the count reaches
        zero; a capture into a released pool's handle fails an internal assert of PyTorch's caching allocator
        (a speculative-only engine whose every step was dropped did, H200, torch 2.11). When no graph is left,
        later captures therefore go to a new pool."""
        for key in keys:
            cap = self.graphs.pop(key, None)
            if cap is not None:
                cap.graph.reset()
        if not self.graphs:
            self.pool = torch.cuda.graph_pool_handle()

    def replay(self, key: Key, *args) -> Any:
        """Fill the key's static inputs from `args`, replay, return the call's share of the outputs."""
        cap = self.graphs[key]
        program = self.programs[key[0]]
        program.fill(key, cap.inputs, *args)
        cap.graph.replay()
        return program.result(key, cap.outputs, *args)
