"""Lowering: (StepProgram, Bucket, device) -> the step callable the engine runs.

    step = lower(StepProgram.speculative("8_4_48", accept="sampled", rows=10), bucket, "cuda")
    out = step(models, inputs)          # inputs / outputs: the named tensors of `ir.signature`

Lowering is a straight sequence of passes: verify the program, check it against the bucket, then emit one
call per node from the table `EMIT` (op -> function). Each emitted function reads and writes the step's named
tensors, so the data flow is exactly the IR's, and a speculative step reads as its program: the drafter's
catch-up block, its levels and the rerank (codegen/draft.py), the target's verify, acceptance, the KV commit
and the output (the hidden rows of the accepted path, the catch-up windows moved on, the host's results in one
tensor). Which kernel runs an op is `codegen.table.kernel`'s choice: Triton on CUDA, the torch references
elsewhere; attention runs inside the models' forwards. `StepModels` is what a step runs on: the models and
their caches, plain data. Nothing here syncs with the host and every shape is fixed by the bucket, so the
engine captures a lowered step as one CUDA graph (rollout/step/graph.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tlt_rt.codegen import draft
from tlt_rt.codegen.table import kernel, maybe_compiled
from tlt_rt.ir.program import Node, Op, StepProgram
from tlt_rt.ir.strategy import Bucket
from tlt_rt.ir.tree import TREE_FIELDS, DraftTree, root_only_tree
from tlt_rt.models.attention import AttnMetadata
from tlt_rt.models.llama import KVCache

Values = dict[str, Any]


@dataclass
class StepModels:
    """What a step runs on: the target and its paged cache, the drafter and its cache (speculative steps),
    the cache's block size, and whether the step's index glue runs compiled (captured steps on CUDA)."""

    target: Any = None  # models.llama.CausalLM
    target_cache: KVCache | None = None
    drafter: Any = None  # models.drafter.Drafter
    drafter_cache: KVCache | None = None
    block_size: int = 16
    compiled: bool = False


@dataclass(frozen=True)
class LoweredStep:
    program: StepProgram
    bucket: Bucket
    device: torch.device
    calls: tuple[tuple[str, Callable[..., None]], ...]  # (node op name, emitted function) in program order

    def __call__(self, models: StepModels, inputs: Values) -> Values:
        values: Values = dict(inputs)
        for _, fn in self.calls:
            fn(models, values)
        return values

    def __str__(self) -> str:
        lines = [f"lowered for {self.bucket} on {self.device}:"]
        lines += [f"  {op:7} -> {fn.__name__}" for op, fn in self.calls]
        return "\n".join(lines)


# ---- emission: one function per op -------------------------------------------------------------------
def _emit_catchup(node: Node, program: StepProgram, device):
    k = node["topk"]

    def catchup(m: StepModels, v: Values) -> None:
        ins = draft.DraftInputs(v["ctx_tokens"], v["ctx_hidden"], v["ctx_len"], v["prefix_lens"], v["block_table"])
        root_logits, root_hidden = draft.catch_up_block(m.drafter, m.drafter_cache, ins, m.block_size, m.compiled)
        front = draft.first_frontier(m.drafter, root_logits, root_hidden, k)
        v["cand_tokens.1"], v["cand_scores.1"] = front.tokens, front.scores
        _store_front(v, 1, front)

    return catchup


def _store_front(v: Values, d: int, front: draft.Frontier) -> None:
    for name in draft.FRONTIER_FIELDS:
        v[f"front_{name}.{d}"] = getattr(front, name)


def _emit_level(node: Node, program: StepProgram, device):
    d, k, depth = node["level"], node["topk"], program.depth

    def level(m: StepModels, v: Values) -> None:
        if d == 2:  # every level's attention inputs at once
            meta = draft.level_inputs(m.drafter_cache, v["prefix_lens"], v["block_table"], v["ctx_len"], k,
                                      depth - 1, m.block_size, m.compiled)  # fmt: skip
            v["level_positions"], v["level_seq_lens"], v["level_slots"], v["level_cu"] = meta
        meta = (v["level_positions"], v["level_seq_lens"], v["level_slots"], v["level_cu"])
        front = draft.Frontier(*(v[f"front_{x}.{d - 1}"] for x in draft.FRONTIER_FIELDS))
        (tokens, scores, parents), front = draft.expand_level(
            m.drafter, m.drafter_cache, front, v["block_table"], meta, d - 2, k
        )
        v[f"cand_tokens.{d}"], v[f"cand_scores.{d}"], v[f"cand_front.{d}"] = tokens, scores, parents
        if d < depth:
            _store_front(v, d, front)

    return level


def _emit_rerank(node: Node, program: StepProgram, device):
    depth, k, t = node["depth"], node["topk"], node["verify_tokens"]

    def rerank(m: StepModels, v: Values) -> None:
        levels = range(1, depth + 1)
        cands = draft.candidates([v[f"cand_tokens.{d}"] for d in levels], [v[f"cand_scores.{d}"] for d in levels],
                                 [v[f"cand_front.{d}"] for d in levels[1:]], k)  # fmt: skip
        _store_tree(v, draft.rerank(cands, v["last_tokens"], v["prefix_lens"], t, m.compiled))

    return rerank


def _store_tree(v: Values, tree: DraftTree) -> None:
    for name in TREE_FIELDS:
        v[name] = getattr(tree, name)


def _emit_root(node: Node, program: StepProgram, device):
    def root(m: StepModels, v: Values) -> None:
        _store_tree(v, root_only_tree(v["last_tokens"].long(), v["prefix_lens"]))

    return root


def _emit_verify(node: Node, program: StepProgram, device):
    t = node["verify_tokens"]

    def verify(m: StepModels, v: Values) -> None:
        tables, prefix_lens, tokens = v["block_table"], v["prefix_lens"], v["tree_tokens"]
        b = tokens.shape[0]
        if t == 1:  # plain decoding: the decode attention path
            bs = m.block_size
            slots = tables.long().gather(1, (prefix_lens // bs)[:, None]).squeeze(1) * bs + prefix_lens % bs
            cu = torch.arange(b + 1, dtype=torch.int32, device=tokens.device)
            meta = AttnMetadata("decode", cu, (prefix_lens + 1).int(), tables, slots, 1)
        else:
            meta = tree_meta(tables, prefix_lens + t, t, v["tree_mask"], m.block_size, compiled=m.compiled)
        out = m.target.forward_paged(tokens.flatten(), v["positions"].flatten(), m.target_cache, meta)
        v["logits"], v["hidden"] = out.logits.view(b, t, -1), out.hidden.view(b, t, -1)

    return verify


def _emit_accept(node: Node, program: StepProgram, device):
    greedy, depth = node["mode"] == "greedy", node["depth"]
    filtering = node["mode"] == "filtered"
    accept_tree = kernel("accept", device)

    def accept(m: StepModels, v: Values) -> None:
        logits = v["logits"]
        b, dev = logits.shape[0], logits.device
        if "tree_tokens" in v:
            tokens, parents = v["tree_tokens"], v["parents"]
        else:  # a first draw: the root alone, its bonus drawn from the given logits
            tokens = torch.zeros(b, 1, dtype=torch.long, device=dev)
            parents = torch.full((b, 1), -1, dtype=torch.long, device=dev)
        # a greedy walk reads no settings and no draws: the rows' own where given, neutral ones otherwise
        # (made only when missing: inside a captured step each would be a kernel)
        temp, top_k, top_p, uniforms = (v.get(name) for name in ("temperature", "top_k", "top_p", "uniforms"))
        if greedy:
            temp = torch.zeros(b, device=dev) if temp is None else temp
            top_k = torch.full((b,), -1, dtype=torch.int32, device=dev) if top_k is None else top_k
            top_p = torch.ones(b, device=dev) if top_p is None else top_p
            uniforms = torch.zeros(b, depth + 1, 2, device=dev) if uniforms is None else uniforms
        elif any(x is None for x in (temp, top_k, top_p, uniforms)):
            missing = [n for n in ("temperature", "top_k", "top_p", "uniforms") if v.get(n) is None]
            raise ValueError(f"a {node['mode']} ACCEPT reads the rows' {', '.join(missing)}: missing from the step")
        out = accept_tree(logits, tokens, parents, temp, top_k, top_p, uniforms, depth, all_greedy=greedy,
                          filtering=filtering)  # fmt: skip
        v.update(out._asdict())

    return accept


def _emit_commit(node: Node, program: StepProgram, device):
    commit = kernel("kv_commit", device)

    def commit_kv(m: StepModels, v: Values) -> None:
        if node["depth"] > 0:  # plain decode wrote its one row in place already
            c = m.target_cache
            layers = [(c.k[i], c.v[i]) for i in range(c.num_layers)]
            commit(layers, v["block_table"], v["prefix_lens"], v["accepted_nodes"], v["accept_len"])
        v["new_prefix_lens"] = v["prefix_lens"] + v["accept_len"] + 1

    return commit_kv


def pack_outputs(acc_len, nodes_acc, hidden, window, tokens, logprobs):
    """(host [B, 1+2(D+1)] f64, hidden [B, D+1, H], moved window [B, R, H] or None) from an acceptance:
    the target hidden at the root and along the accepted path (positions L .. L+a), and the catch-up
    windows moved on by the accepted length."""
    dlen = tokens.shape[1] - 1
    nodes = torch.cat([torch.zeros_like(nodes_acc[:, :1]), nodes_acc[:, :dlen]], 1).clamp(min=0)
    hid = hidden.gather(1, nodes[..., None].expand(-1, -1, hidden.shape[-1]))
    moved = None
    if window is not None:  # rows [a+1, a+1+W) of window ++ hid end at position L+a+1
        w, h = window.shape[1], window.shape[2]
        shift = (acc_len + 1)[:, None] + torch.arange(w, device=window.device)
        moved = torch.cat([window, hid.to(window.dtype)], 1).gather(1, shift[..., None].expand(-1, -1, h))
    host = torch.cat([acc_len[:, None].double(), tokens.double(), logprobs.double()], 1)
    return host, hid, moved


def _emit_output(node: Node, program: StepProgram, device):
    def output(m: StepModels, v: Values) -> None:
        pack = maybe_compiled(pack_outputs, m.compiled, v["hidden"].device)
        window = v["ctx_hidden"] if node["rows"] else None
        host, hid, moved = pack(v["accept_len"], v["accepted_nodes"], v["hidden"], window, v["accepted_tokens"],
                                v["logprobs"])  # fmt: skip
        v["host"], v["out_hidden"] = host, hid
        if moved is not None:
            v["window"] = moved

    return output


EMIT: dict[Op, Callable] = {Op.CATCHUP: _emit_catchup, Op.LEVEL: _emit_level, Op.RERANK: _emit_rerank,
                            Op.ROOT: _emit_root, Op.VERIFY: _emit_verify, Op.ACCEPT: _emit_accept,
                            Op.COMMIT: _emit_commit, Op.OUTPUT: _emit_output}  # fmt: skip


# ---- the verify tree's attention inputs ---------------------------------------------------------------
def tree_slots(tables: torch.Tensor, seq_lens: torch.Tensor, q_len: int, block_size: int, write=None):
    """The index work of `tree_meta`: (cu_seqlens [B+1] int32, seq_lens [B] int32, slots [B*q_len])."""
    b, dev = tables.shape[0], tables.device
    pos = seq_lens.long()[:, None] - q_len + torch.arange(q_len, device=dev)  # [B, q_len]
    slots = tables.long().gather(1, pos.clamp(min=0) // block_size) * block_size + pos % block_size
    keep = pos >= 0 if write is None else (pos >= 0) & write
    slots = torch.where(keep, slots, -1)
    cu = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device=dev)
    return cu, seq_lens.int(), slots.flatten()


def tree_meta(tables, seq_lens, q_len: int, tree_mask, block_size: int, write=None, compiled: bool = False):
    """Verify-mode metadata built on the device: every sequence's q_len new tokens sit at the last q_len of
    its seq_lens cache positions. tables [B, W] int32, seq_lens [B]; no host round trip. `compiled`: the
    index work through torch.compile (one or two kernels inside a captured step).

    A token at a negative cache position (seq_lens < q_len), or where `write` [B, q_len] bool is False,
    writes its K/V to the trash slot."""
    slots_fn = maybe_compiled(tree_slots, compiled, tables.device)
    cu, lens, slots = slots_fn(tables, seq_lens, q_len, block_size, write)
    return AttnMetadata("verify", cu, lens, tables, slots, q_len, tree_mask)


# ---- passes -------------------------------------------------------------------------------------------
def _check_bucket(program: StepProgram, bucket: Bucket) -> None:
    if not program.is_draw and program.strategy != bucket.strategy:
        raise ValueError(f"bucket {bucket} serves strategy {bucket.strategy}, the program {program.strategy}")


def lower(program: StepProgram, bucket: Bucket, device: torch.device | str) -> LoweredStep:
    """Verify `program`, check it fits `bucket`, and emit one call per node for `device`."""
    device = torch.device(device)
    program.verify()
    _check_bucket(program, bucket)
    calls = tuple((n.op.name, EMIT[n.op](n, program, device)) for n in program.nodes)
    return LoweredStep(program, bucket, device, calls)
