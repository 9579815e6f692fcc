"""The target side of a step: batch layout, attention metadata, the eager forward and the first-token draw.

The scheduler decides what runs; this module turns its choice into tensors. Every token is drawn by the
tree-acceptance rule (the ACCEPT node, `codegen/kernels/accept.py`): a plain step and the first token after a
prefill (`StepProgram.first_draw`) are an acceptance of depth 0, with uniforms from each sequence's own
counter-based stream.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from tlt_rt.codegen.lower import StepModels, lower
from tlt_rt.ir.program import StepProgram
from tlt_rt.ir.strategy import Bucket
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import CausalLM, KVCache, ModelOutput
from tlt_rt.rollout.block_manager import Tables
from tlt_rt.rollout.params import SamplingParams
from tlt_rt.rollout.step.rng import host_uniforms


@dataclass
class Layout:
    """Host-side description of a packed batch: sequence i's new tokens are the q_lens[i] positions from
    starts[i] on (rotary and cache positions alike) under block table tables[i]."""

    tables: list[list[int]]
    starts: list[int]
    q_lens: list[int]

    @property
    def seq_lens(self) -> list[int]:
        """Cached tokens per sequence once the new ones are written."""
        return [s + q for s, q in zip(self.starts, self.q_lens, strict=True)]


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the work already queued there: on CUDA through a pinned
    staging copy and an asynchronous upload (a pageable `.to` drains the stream first, so a loop of small
    uploads after a big forward waits for the forward at each one). The pinned buffer is not reused before
    the upload is done (the caching host allocator records it on the stream)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def table_tensor(tables: list[list[int]], device) -> torch.Tensor:
    """[B, max blocks] int32 block tables, padded with block 0 (attention masks padded positions out)."""
    return Tables.of(tables).tensor(device=device)


def build_meta(layout: Layout, mode: str, block_size: int, device, tree_mask: torch.Tensor | None = None):
    """AttnMetadata and flat positions for a layout (one host->device copy per tensor). The positions and
    slots of every new token are computed in numpy (a Python loop over 13k prompt tokens took ~4 ms)."""
    q = np.asarray(layout.q_lens, dtype=np.int64)
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    seq = np.repeat(np.arange(len(q)), q)  # [N] the sequence of each new token
    positions = np.arange(cu[-1]) + np.repeat(np.asarray(layout.starts, dtype=np.int64) - cu[:-1], q)
    tables = Tables.of(layout.tables)
    slots = tables.array[seq, positions // block_size] * block_size + positions % block_size
    seq_lens = layout.seq_lens
    cu_host = cu.tolist()
    meta = AttnMetadata(
        mode=mode,
        cu_seqlens_q=to_device(torch.from_numpy(cu.astype(np.int32)), device),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        block_tables=to_device(tables.tensor(), device),
        slot_mapping=to_device(torch.from_numpy(slots), device),
        max_q_len=int(q.max()),
        tree_mask=tree_mask,
        host=(cu_host, seq_lens),
    )
    return meta, to_device(torch.from_numpy(positions), device)


def draw(logits: torch.Tensor, params: SamplingParams | list[SamplingParams], seeds: list[int], counters: list[int]):
    """logits [B, V] -> (tokens [B], logprobs [B]) on the device: the first-draw program (an acceptance of depth
    0, the bonus alone: the rule and kernel every speculative and plain step draws with), from each sequence's
    (seed, counter) stream. Used for the first token of each sample after its prompt's prefill. `params` is one
    setting for every row or one per row."""
    b, dev = logits.shape[0], logits.device
    rows = params if isinstance(params, list) else [params] * b
    mode = batch_mode(rows)
    values = {"logits": logits[:, None]}
    if mode != "greedy":
        values["uniforms"] = to_device(torch.from_numpy(host_uniforms(seeds, counters, 2)), dev).view(b, 1, 2)
        values["temperature"] = to_device(torch.tensor([float(p.temperature) for p in rows], dtype=torch.float32), dev)
        values["top_k"] = to_device(torch.tensor([int(p.top_k) for p in rows], dtype=torch.int32), dev)
        values["top_p"] = to_device(torch.tensor([float(p.top_p) for p in rows], dtype=torch.float32), dev)
    out = _first_draw(mode, dev)(StepModels(), values)
    return out["bonus"], out["logprobs"][:, 0]


@functools.cache
def _first_draw(mode: str, device: torch.device):
    bucket = Bucket(1, None, 1, 1, 1, 1)  # a first draw reads only its logits: the bucket sizes nothing
    return lower(StepProgram.first_draw(mode), bucket, device)


def accept_mode(params: SamplingParams) -> str:
    if params.greedy:
        return "greedy"
    return "filtered" if params.filtering else "sampled"


def batch_mode(rows: list[SamplingParams]) -> str:
    """The acceptance mode serving every row of a batch: greedy rows run exactly as greedy inside a sampled
    program (temperature 0 is a per-row greedy walk) and unfiltered rows inside a filtered one."""
    modes = {accept_mode(p) for p in rows}
    return next((mode for mode in ("filtered", "sampled") if mode in modes), "greedy")


class TargetRunner:
    """Owns the target model, its paged cache and its eager forward."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        self.model = model
        self.device = model.lm_head.weight.device
        self.block_size = block_size
        self.cache: KVCache = model.make_cache(num_blocks + 1, block_size)  # + the trash block

    @torch.no_grad()
    def forward(self, tokens: list[int], layout: Layout, mode: str, logits_rows=None, tree_mask=None):
        meta, positions = build_meta(layout, mode, self.block_size, self.device, tree_mask)
        ids = to_device(torch.tensor(tokens, dtype=torch.long), self.device)
        rows = None if logits_rows is None else to_device(torch.tensor(logits_rows, dtype=torch.long), self.device)
        return self.model.forward_paged(ids, positions, self.cache, meta, logits_indices=rows)

    def copy_blocks(self, copies: list[tuple[int, int]], caches: list[KVCache]) -> None:
        """Apply copy-on-fork block copies (src, dst) to every cache that shares the block tables: one upload
        and one gather + scatter per cache and tensor, every source read before any destination is written
        (a block may be one copy's source and a later fork's destination). Destinations must be distinct."""
        if not copies:
            return
        src, dst = to_device(torch.tensor(copies, dtype=torch.long).t().contiguous(), self.device)
        for c in caches:
            c.k[:, dst] = c.k[:, src]
            c.v[:, dst] = c.v[:, src]


MIN_PREFILL_GRAPH = 64  # the smallest token count a one-sequence prefill is captured at


def prefill_graph_sizes(most: int) -> list[int]:
    """Token counts a one-sequence prefill chunk is padded to (and captured at): powers of two from
    MIN_PREFILL_GRAPH up to `most`, and `most` itself; none for 0."""
    sizes, t = [], MIN_PREFILL_GRAPH
    while 0 < t < most:
        sizes.append(t)
        t *= 2
    return sizes + [most] if most > 0 else []


class PaddedPrefill:
    """The prefill of one sequence's chunk of up to T new tokens as a program of fixed shapes (a
    `codegen.graphs.Program` of kind "prefill", key ("prefill", T)). An eager prefill launches every layer's
    kernels from the host, which for one short prompt costs far more than the kernels do; captured, it is one
    replay. The chunk's n tokens are padded to T: the padding tokens sit after the real ones, write their K/V to
    the trash slot, and only padding rows attend to their positions (causal), so the real rows compute what the
    unpadded prefill computes; logits come from the last real row. Needs the chunk's first position plus T within
    the sequence's block-table width (`slots`)."""

    def __init__(self, runner: TargetRunner, width: int, sizes: list[int]):
        self.runner, self.width, self.sizes = runner, width, list(sizes)

    def size_for(self, start: int, n: int) -> int | None:
        """The padded size for a chunk of n tokens from position `start`, or None where none fits."""
        room = self.width * self.runner.block_size - start
        return next((t for t in self.sizes if n <= t <= room), None)

    def static_inputs(self, key) -> dict[str, torch.Tensor]:
        t, dev = key[1], self.runner.device
        return dict(
            ids=torch.zeros(t, dtype=torch.long, device=dev),
            positions=torch.arange(t, dtype=torch.long, device=dev),
            slots=torch.full((t,), -1, dtype=torch.long, device=dev),
            seq_lens=torch.full((1,), t, dtype=torch.int32, device=dev),
            cu=torch.tensor([0, t], dtype=torch.int32, device=dev),
            table=torch.zeros(1, self.width, dtype=torch.int32, device=dev),
            last=torch.zeros(1, dtype=torch.long, device=dev),
        )

    def run(self, key, ins: dict[str, torch.Tensor]):
        meta = AttnMetadata("prefill", ins["cu"], ins["seq_lens"], ins["table"], ins["slots"], key[1])
        return self.runner.model.forward_paged(ins["ids"], ins["positions"], self.runner.cache, meta, ins["last"])

    def fill(self, key, ins: dict[str, torch.Tensor], tokens: list[int], start: int, table: list[int]) -> None:
        t, n, bs = key[1], len(tokens), self.runner.block_size
        positions = np.arange(start, start + t, dtype=np.int64)
        row = np.zeros(self.width, dtype=np.int32)
        row[: len(table)] = table
        slots = np.full(t, -1, dtype=np.int64)
        slots[:n] = row[positions[:n] // bs].astype(np.int64) * bs + positions[:n] % bs
        ids = np.zeros(t, dtype=np.int64)
        ids[:n] = tokens
        ints = np.concatenate([ids, positions, slots, [start + t, n - 1], row])
        dev = to_device(torch.from_numpy(ints), self.runner.device)  # one upload for every input
        ins["ids"].copy_(dev[:t])
        ins["positions"].copy_(dev[t : 2 * t])
        ins["slots"].copy_(dev[2 * t : 3 * t])
        ins["seq_lens"].copy_(dev[3 * t : 3 * t + 1])
        ins["last"].copy_(dev[3 * t + 1 : 3 * t + 2])
        ins["table"].copy_(dev[3 * t + 2 :][None])

    def result(self, key, outputs, tokens: list[int], start: int, table: list[int]):
        """The chunk's logits (its last real row) and its real rows' hidden states, copied out of the graph's
        buffers (a later replay of the shared pool reuses them; the caller keeps the hidden rows)."""
        return ModelOutput(logits=outputs.logits, hidden=outputs.hidden[: len(tokens)].clone())

    def __call__(self, tokens: list[int], start: int, table: list[int], t: int):
        """The program run eagerly (no graph: CPU, or a device without a pool), with the same arithmetic."""
        key = ("prefill", t)
        ins = self.static_inputs(key)
        self.fill(key, ins, tokens, start, table)
        return self.result(key, self.run(key, ins), tokens, start, table)
