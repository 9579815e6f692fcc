"""CUDA-graph pool: one captured paged forward per static shape, all sharing one memory pool.

A shape key is (mode, batch bucket, new tokens per sequence, tree window). Plain decode is
("decode", B, 1, 1); a target verify of T tree tokens is ("verify", B, T, T) and is shared by every
strategy with the same verify_tokens; a drafter tree level is ("verify", B, K, d*K). Graphs are captured
largest batch first so that smaller ones reuse the pool's blocks; inputs live in static buffers that a
replay fills (padding rows write nowhere and read one cached position), outputs are the graph's own
tensors and stay valid until the next replay of the same graph. Prefill and anything larger than the
biggest bucket run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_rt.models.attention import AttnMetadata

Key = tuple[str, int, int, int]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, torch.Tensor]  # logits [B*T, V], hidden [B*T, H]


class GraphPool:
    """Captures `forward(input_ids, positions, cache, meta, extra)` per shape key; replays with padding."""

    def __init__(self, forward, cache, max_blocks_per_seq: int, device: torch.device, extra_dim: int = 0):
        self.forward = forward  # callable(ids, positions, cache, meta, extra) -> ModelOutput
        self.cache = cache
        self.width = max_blocks_per_seq
        self.device = device
        self.extra_dim = extra_dim  # > 0: a per-token float input (the drafter's hidden) of this width
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Key, _Captured] = {}
        self.pool_bytes = 0

    def _static_inputs(self, key: Key) -> dict[str, torch.Tensor]:
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
        if self.extra_dim:
            dtype = self.cache.k.dtype
            ins["extra"] = torch.zeros(n, self.extra_dim, dtype=dtype, device=dev)
        return ins

    def _meta(self, key: Key, ins: dict[str, torch.Tensor]) -> AttnMetadata:
        mode, _, t, _ = key
        return AttnMetadata(
            mode, ins["cu"], ins["seq_lens"], ins["tables"], ins["slots"], t, ins["mask"] if mode == "verify" else None
        )

    def _run(self, key: Key, ins: dict[str, torch.Tensor]):
        out = self.forward(ins["ids"], ins["positions"], self.cache, self._meta(key, ins), ins.get("extra"))
        return out.logits, out.hidden

    def capture(self, keys: list[Key]) -> None:
        """Capture every key, largest batch first, into the shared pool."""
        before = torch.cuda.memory_reserved(self.device)
        for key in sorted(keys, key=lambda k: (-k[1] * k[2], k)):
            if key in self.graphs:
                continue
            ins = self._static_inputs(key)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(2):  # warm-up compiles kernels outside the graph
                    self._run(key, ins)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
                outs = self._run(key, ins)
            self.graphs[key] = _Captured(graph, ins, outs)
        torch.cuda.synchronize(self.device)
        self.pool_bytes += torch.cuda.memory_reserved(self.device) - before

    def has(self, key: Key) -> bool:
        return key in self.graphs

    def replay(self, key: Key, ids, positions, meta: AttnMetadata, extra=None):
        """Copy one step's inputs into the key's static buffers (padding the batch) and replay."""
        cap = self.graphs[key]
        ins = cap.inputs
        n, b = ids.shape[0], meta.seq_lens.shape[0]
        ins["ids"][:n].copy_(ids)
        ins["positions"][:n].copy_(positions)
        ins["slots"][:n].copy_(meta.slot_mapping)
        ins["slots"][n:].fill_(-1)
        ins["seq_lens"][:b].copy_(meta.seq_lens)
        ins["seq_lens"][b:].fill_(key[3])
        w = meta.block_tables.shape[1]
        ins["tables"][:b, :w].copy_(meta.block_tables)
        ins["tables"][:b, w:].zero_()
        ins["tables"][b:].zero_()
        if meta.tree_mask is not None:
            ins["mask"][:b].copy_(meta.tree_mask)
        if extra is not None:
            ins["extra"][:n].copy_(extra)
        cap.graph.replay()
        logits, hidden = cap.outputs
        return logits[:n], hidden[:n]
