"""The named tensors of a step program: what the step is given, what each node reads and makes.

Symbols: B batch (the bucket's), R the drafter's catch-up rows, D depth, K topk, T verify_tokens (1 for plain
decoding), V vocabulary, H the target's hidden rows the drafter reads (its fused features), Hd the drafter's own
hidden size, W the block table's width. "act" is the model's compute dtype (e.g. bf16).

Step inputs: last_tokens [B] (the last emitted token, the tree's root, not yet in the KV cache), prefix_lens [B]
(tokens in the KV cache: the root sits at position prefix_lens), block_table [B, W]. With a draft also the
drafter's catch-up block, rows p = prefix_lens-R .. prefix_lens-1 (every row the last step's accepted path
added, and rows seen before, recomputed): ctx_hidden [B, R, H] the target hidden at p, ctx_tokens [B, R] the
token at p+1 (the last is the root), ctx_len [B] its real rows, min(prefix_lens, R) (rows before position 0
are padding; 0 marks a padding sequence). With sampled or filtered acceptance also uniforms [B, D+1, 2] (the
walk's draws at each depth, accept scan and bonus draw, filled on the device so nothing syncs) and the rows'
temperature [B], top_k [B] (-1 off) and top_p [B]. A first draw is given logits [B, 1, V] instead of a tree.

Nodes (level d = 1..D; `.d` names a level's tensors):
  CATCHUP  the drafter over the block: level 1's candidates cand_tokens.1 / cand_scores.1 [B, K] (the root's K
           best children, target ids, log-probs) and the first frontier front_tokens.1, front_scores.1,
           front_index.1 [B, K] (each frontier node's flat candidate index), front_feats.1 [B, K, Hd] (the
           drafter output the frontier's children are drafted from), front_mask.1 [B, K, K] (its tree mask)
  LEVEL d  the drafter over frontier d-1: level d's K*K candidates (cand_tokens.d, cand_scores.d [B, K*K],
           frontier-major: child j hangs from frontier node j // K, whose flat candidate index cand_front.d
           [B, K] keeps) and frontier d (front_mask.d [B, K, dK]);
           level 2 also makes every level's attention inputs at once (level_positions, level_seq_lens,
           level_slots [D-1, B, K or -], level_cu [B*K+1])
  RERANK   every candidate -> the verify tree (ir/tree.py `DraftTree`): tree_tokens, parents, depths,
           positions [B, T], tree_mask [B, T, T], paths [B, T, D+1], children [B, T, K], num_children [B, T]
  ROOT     the same fields for the root alone (T = 1)
  VERIFY   logits [B, T, V], hidden [B, T, H] of every tree node (its K/V written at [prefix_lens, +T))
  ACCEPT   accept_len [B] (accepted draft tokens, 0..D); accepted_tokens [B, D+1] (the accepted draft tokens,
           then the bonus at index accept_len, -1 after); accepted_nodes [B, D+1] (tree node of each accepted
           token, -1 from accept_len on: the bonus has no node); bonus [B]; logprobs [B, D+1] f32 (the target's
           log-prob of each emitted token, read only [:accept_len+1])
  COMMIT   the root's K/V stays at prefix_lens, accepted node accepted_nodes[:, i] moves to prefix_lens + 1 + i;
           new_prefix_lens [B] = prefix_lens + accept_len + 1 (the bonus is the next root, not yet cached)
  OUTPUT   host [B, 1 + 2(D+1)] f64 (accept length, tokens, log-probs: what reaches the host in one copy),
           out_hidden [B, D+1, H] (the target hidden at the root and along the accepted path), and with a draft
           window [B, R, H] (the catch-up block's hidden rows moved on by the accepted length + 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .strategy import Bucket
from .tree import TREE_FIELDS

I64, I32, F32, F64, BOOL = torch.int64, torch.int32, torch.float32, torch.float64, torch.bool
SETTINGS = ("uniforms", "temperature", "top_k", "top_p")


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one named tensor; dtype None means the model's compute dtype (e.g. bf16)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None

    def __str__(self) -> str:
        short = {I64: "i64", I32: "i32", BOOL: "bool", F32: "f32", F64: "f64"}
        return f"[{','.join(map(str, self.shape))}]:{short.get(self.dtype, 'act')}"


@dataclass(frozen=True)
class NodeSignature:
    """The tensors a node reads and makes, by name."""

    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]


def _sizes(nodes, bucket: Bucket) -> tuple[int, int, int, int]:
    """(D, K, T, R) of a program's nodes."""
    by = {n.op.name: n for n in nodes}
    rerank, catchup = by.get("RERANK"), by.get("CATCHUP")
    d, k, t = (0, 1, 1) if rerank is None else (rerank["depth"], rerank["topk"], rerank["verify_tokens"])
    return d, k, t, 0 if catchup is None else catchup["rows"]


def step_inputs(nodes, bucket: Bucket) -> dict[str, TensorSpec]:
    """Tensors the engine hands a program of `nodes` (module docstring)."""
    B, H, V = bucket.batch_size, bucket.hidden_size, bucket.vocab_size
    D, _, _, R = _sizes(nodes, bucket)
    ops = {n.op.name: n for n in nodes}
    if "VERIFY" in ops:
        specs = {
            "last_tokens": TensorSpec((B,), I64),
            "prefix_lens": TensorSpec((B,), I64),
            "block_table": TensorSpec((B, bucket.max_blocks_per_seq), I32),
        }
    else:  # a first draw
        specs = {"logits": TensorSpec((B, 1, V), None)}
    if R:
        specs |= {"ctx_tokens": TensorSpec((B, R), I64), "ctx_hidden": TensorSpec((B, R, H), None),
                  "ctx_len": TensorSpec((B,), I64)}  # fmt: skip
    if ops["ACCEPT"]["mode"] != "greedy":
        specs |= {"uniforms": TensorSpec((B, D + 1, 2), F32), "temperature": TensorSpec((B,), F32),
                  "top_k": TensorSpec((B,), I32), "top_p": TensorSpec((B,), F32)}  # fmt: skip
    return specs


def _tree_specs(B: int, T: int, D: int, K: int) -> dict[str, TensorSpec]:
    shapes = [(B, T), (B, T), (B, T), (B, T), (B, T, T), (B, T, D + 1), (B, T, K), (B, T)]
    dtypes = [BOOL if name == "tree_mask" else I64 for name in TREE_FIELDS]
    return {name: TensorSpec(s, t) for name, s, t in zip(TREE_FIELDS, shapes, dtypes, strict=True)}


def _frontier(d: int, B: int, K: int, Hd: int) -> dict[str, TensorSpec]:
    return {f"front_tokens.{d}": TensorSpec((B, K), I64), f"front_scores.{d}": TensorSpec((B, K), F32),
            f"front_index.{d}": TensorSpec((B, K), I64), f"front_feats.{d}": TensorSpec((B, K, Hd), None),
            f"front_mask.{d}": TensorSpec((B, K, d * K), BOOL)}  # fmt: skip


def node_io(node, nodes, bucket: Bucket) -> tuple[list[str], dict[str, TensorSpec]]:
    """(names a node reads, specs of what it makes)."""
    B, V, H, Hd = bucket.batch_size, bucket.vocab_size, bucket.hidden_size, bucket.draft_hidden
    D, K, T, R = _sizes(nodes, bucket)
    op = node.op.name
    if op == "CATCHUP":
        made = {"cand_tokens.1": TensorSpec((B, K), I64), "cand_scores.1": TensorSpec((B, K), F32)}
        return ["ctx_tokens", "ctx_hidden", "ctx_len", "prefix_lens", "block_table"], made | _frontier(1, B, K, Hd)
    if op == "LEVEL":
        d = node["level"]
        reads = [f"front_{x}.{d - 1}" for x in ("tokens", "scores", "index", "feats", "mask")]
        made = {f"cand_tokens.{d}": TensorSpec((B, K * K), I64), f"cand_scores.{d}": TensorSpec((B, K * K), F32),
                f"cand_front.{d}": TensorSpec((B, K), I64)}  # fmt: skip
        if d == 2:
            made |= {"level_positions": TensorSpec((D - 1, B, K), I64), "level_seq_lens": TensorSpec((D - 1, B), I32),
                     "level_slots": TensorSpec((D - 1, B, K), I64),
                     "level_cu": TensorSpec((B * K + 1,), I32)}  # fmt: skip
            reads += ["ctx_len", "prefix_lens", "block_table"]
        else:
            reads += ["level_positions", "level_seq_lens", "level_slots", "level_cu", "block_table"]
        return reads, made | (_frontier(d, B, K, Hd) if d < D else {})
    if op == "RERANK":
        cands = [f"cand_{x}.{d}" for d in range(1, D + 1) for x in ("tokens", "scores", "front")]
        cands.remove("cand_front.1")  # level 1's parent is the root
        return [*cands, "last_tokens", "prefix_lens"], _tree_specs(B, T, D, K)
    if op == "ROOT":
        return ["last_tokens", "prefix_lens"], _tree_specs(B, 1, 0, 1)
    if op == "VERIFY":
        reads = ["tree_tokens", "positions", "tree_mask", "prefix_lens", "block_table"]
        return reads, {"logits": TensorSpec((B, T, V), None), "hidden": TensorSpec((B, T, H), None)}
    if op == "ACCEPT":
        tree = ["tree_tokens", "parents"] if len(nodes) > 1 else []
        draws = list(SETTINGS) if node["mode"] != "greedy" else []
        made = {"accept_len": TensorSpec((B,), I64), "accepted_tokens": TensorSpec((B, D + 1), I64),
                "accepted_nodes": TensorSpec((B, D + 1), I64), "bonus": TensorSpec((B,), I64),
                "logprobs": TensorSpec((B, D + 1), F32)}  # fmt: skip
        return ["logits", *tree, *draws], made
    if op == "COMMIT":
        reads = ["accepted_nodes", "accept_len", "prefix_lens", "block_table"]
        return reads, {"new_prefix_lens": TensorSpec((B,), I64)}
    reads = ["accept_len", "accepted_nodes", "accepted_tokens", "logprobs", "hidden"] + (["ctx_hidden"] if R else [])
    made = {"host": TensorSpec((B, 1 + 2 * (D + 1)), F64), "out_hidden": TensorSpec((B, D + 1, H), None)}
    return reads, made | ({"window": TensorSpec((B, R, H), None)} if R else {})


def signature(nodes, bucket: Bucket) -> dict:
    """{node: NodeSignature} of a verified program's nodes, in order; every name a node reads was given to
    the step or made by an earlier node."""
    made = dict(step_inputs(nodes, bucket))
    out = {}
    for node in nodes:
        reads, makes = node_io(node, nodes, bucket)
        out[node] = NodeSignature({name: made[name] for name in reads}, makes)
        made.update(makes)
    return out


def pretty(nodes, sig: dict, inputs: dict[str, TensorSpec], bucket: Bucket) -> str:
    """One line per node with its inputs (<-) and outputs (->) and their shapes."""

    def tensors(specs: dict[str, TensorSpec]) -> str:
        return " ".join(f"{name}{spec}" for name, spec in specs.items())

    lines = [
        f"StepProgram bucket {bucket}: V={bucket.vocab_size} H={bucket.hidden_size} block_size={bucket.block_size}",
        f"   inputs   {tensors(inputs)}",
    ]
    for i, (node, s) in enumerate(sig.items()):
        lines += [f"%{i} {node}", f"   <- {tensors(s.inputs)}", f"   -> {tensors(s.outputs)}"]
    return "\n".join(lines)
