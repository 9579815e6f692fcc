"""CUDA-graph pool: one captured program per static shape key, all sharing one memory pool.

A key is (kind, batch bucket, tokens per sequence, ...); its kind names the `Program` that captures it.
The paged forward (`PagedProgram`) serves "decode" ("decode", B, 1, 1) and "verify" ("verify", B, T, W):
a target verify of T tree tokens is ("verify", B, T, T) and is shared by every strategy with the same
verify_tokens. The engine adds a "draft" program (rollout/drafting.py): a whole drafter step per
(bucket, strategy). Graphs are captured largest first so that smaller ones reuse the pool's blocks;
inputs live in static buffers that a replay fills (padding rows write nowhere), and prefill and anything
larger than the biggest bucket run eagerly.

Sharing one pool means a graph's intermediates may sit where another graph's outputs were allocated if
that graph was captured later. The forward's outputs are the graph's own tensors and are read before any
other graph of the pool replays; a program whose outputs must outlive another replay (the draft tree is
read after the verify replay) copies them into buffers allocated outside the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tlt_rt.models.attention import AttnMetadata

Key = tuple  # (kind: str, batch: int, tokens: int, ...)


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
        """Capture every key, largest batch x tokens first, into the shared pool."""
        before = self._reserved()
        for key in sorted(keys, key=lambda k: (-k[1] * k[2], k)):
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
        and the static inputs), not the warm-up runs' transient blocks."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def has(self, key: Key) -> bool:
        return key in self.graphs

    def replay(self, key: Key, *args) -> Any:
        """Fill the key's static inputs from `args`, replay, return the call's share of the outputs."""
        cap = self.graphs[key]
        program = self.programs[key[0]]
        program.fill(key, cap.inputs, *args)
        cap.graph.replay()
        return program.result(key, cap.outputs, *args)


class PagedProgram:
    """A paged model forward, `forward(input_ids, positions, cache, meta) -> ModelOutput`, as a program for
    keys ("decode" | "verify", B, T, W); replay arguments are (ids, positions, meta)."""

    def __init__(self, forward, cache, max_blocks_per_seq: int, device: torch.device):
        self.forward = forward
        self.cache = cache
        self.width = max_blocks_per_seq
        self.device = device

    def static_inputs(self, key: Key) -> dict[str, torch.Tensor]:
        mode, b, t, w = key
        dev = self.device
        n = b * t
        ins = {
            "ids": torch.zeros(n, dtype=torch.long, device=dev),
            "positions": torch.zeros(n, dtype=torch.long, device=dev),
            "slots": torch.full((n,), -1, dtype=torch.long, device=dev),
            "seq_lens": torch.full((b,), w, dtype=torch.int32, device=dev),
            "tables": torch.zeros(b, self.width, dtype=torch.int32, device=dev),
            "cu": torch.arange(0, n + 1, t, dtype=torch.int32, device=dev),
            "mask": torch.zeros(b, t, w, dtype=torch.bool, device=dev),
        }
        # padding rows see only themselves
        ins["mask"][:, torch.arange(t), w - t + torch.arange(t)] = True
        return ins

    def run(self, key: Key, ins: dict[str, torch.Tensor]):
        mode, _, t, _ = key
        meta = AttnMetadata(
            mode, ins["cu"], ins["seq_lens"], ins["tables"], ins["slots"], t, ins["mask"] if mode == "verify" else None
        )
        out = self.forward(ins["ids"], ins["positions"], self.cache, meta)
        return out.logits, out.hidden

    def fill(self, key: Key, ins: dict[str, torch.Tensor], ids, positions, meta: AttnMetadata) -> None:
        n, b = ids.shape[0], meta.seq_lens.shape[0]
        ins["ids"][:n].copy_(ids)
        ins["positions"][:n].copy_(positions)
        ins["slots"][:n].copy_(meta.slot_mapping)
        ins["slots"][n:].fill_(-1)
        ins["seq_lens"][:b].copy_(meta.seq_lens)
        ins["seq_lens"][b:].fill_(key[3])
        fill_tables(ins["tables"], meta.block_tables)
        if meta.tree_mask is not None:
            ins["mask"][:b].copy_(meta.tree_mask)

    def result(self, key: Key, outputs, ids, *_):
        logits, hidden = outputs
        n = ids.shape[0]
        return logits[:n], hidden[:n]


def fill_tables(static: torch.Tensor, tables: torch.Tensor) -> None:
    """Copy block tables [b, w] into a static [B, W] buffer; the rest (padding rows, columns) reads block 0."""
    b, w = tables.shape
    static[:b, :w].copy_(tables)
    static[:b, w:].zero_()
    static[b:].zero_()
