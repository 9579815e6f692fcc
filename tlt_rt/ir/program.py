# Over ~300 lines on purpose: the IR's one program type with its node, tensor signatures and the validation
# that is the contract between the IR, codegen and the engine; split, that contract would be in pieces.
"""A speculative step as a program: DRAFT -> VERIFY -> ACCEPT -> COMMIT.

One node type (`Node`: an `Op` plus attributes, edited through `replace`) in a straight-line
`StepProgram`. Data flows by tensor name: each node reads named tensors made by earlier nodes or given
to the step (`StepProgram.step_inputs`) and makes new ones; `signature(bucket)` gives every name's shape
and dtype, which is the contract between the IR, codegen and the engine.

Plain decode is the same program without DRAFT: VERIFY sends 1 token per sequence, and ACCEPT with
depth 0 just picks (argmax or sampled) the bonus token, so greedy/sampled acceptance, log-probs and the
KV commit have one code path for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from .strategy import Bucket, Strategy


class Op(IntEnum):
    """Node kinds, in the only order a program may hold them."""

    DRAFT = 0
    VERIFY = 1
    ACCEPT = 2
    COMMIT = 3


class IRError(ValueError):
    """An ill-formed StepProgram; the message starts with the offending node, e.g. "%2 ACCEPT: ..."."""

    def __init__(self, index: int, node: Node | None, message: str) -> None:
        self.index, self.node = index, node
        name = node.op.name if node is not None and isinstance(node.op, Op) else "?"
        super().__init__(f"%{index} {name}: {message}")


# the attributes each op carries, in print order
ATTRS: dict[Op, tuple[str, ...]] = {
    Op.DRAFT: ("depth", "topk", "verify_tokens"),
    Op.VERIFY: ("verify_tokens",),
    Op.ACCEPT: ("mode", "depth", "temperature", "top_k", "top_p"),
    Op.COMMIT: ("depth",),
}
# greedy: the argmax walk; sampled: the exact rejection walk over the temperature-scaled distribution; filtered:
# the same over the top-k / top-p filtered one (a captured step of a mode serves any per-row settings it covers:
# greedy rows inside a sampled step, unfiltered rows inside a filtered one)
ACCEPT_MODES = ("greedy", "sampled", "filtered")


@dataclass(frozen=True)
class Node:
    """One step of the program: an op and its attributes (name, value) pairs, hashable."""

    op: Op
    attrs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def make(cls, op: Op, **attrs: Any) -> Node:
        return cls(op, tuple(attrs.items()))

    def __getitem__(self, name: str) -> Any:
        for key, value in self.attrs:
            if key == name:
                return value
        raise KeyError(f"{self.op.name} has no attribute {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)

    def replace(self, **changes: Any) -> Node:
        """A copy with `op` and/or attributes changed (an unknown name adds an attribute)."""
        op = changes.pop("op", self.op)
        attrs = dict(self.attrs)
        attrs.update(changes)
        return Node(op, tuple(attrs.items()))

    def __str__(self) -> str:
        name = self.op.name if isinstance(self.op, Op) else repr(self.op)
        return " ".join([f"{name:<7}"] + [f"{k}={v}" for k, v in self.attrs])


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one named tensor; dtype None means the model's compute dtype (e.g. bf16)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None

    def __str__(self) -> str:
        short = {torch.int64: "i64", torch.int32: "i32", torch.bool: "bool", torch.float32: "f32"}
        return f"[{','.join(map(str, self.shape))}]:{short.get(self.dtype, 'act')}"


@dataclass(frozen=True)
class NodeSignature:
    """The tensors a node reads and makes, by name."""

    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class StepProgram:
    """A straight-line program: [DRAFT,] VERIFY, ACCEPT, COMMIT. Build with `speculative` or
    `plain_decode` (both verified); programs edited by hand are checked with `verify()`."""

    nodes: tuple[Node, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))

    # ---- builders -------------------------------------------------------------------------------------

    @classmethod
    def speculative(
        cls,
        strategy: Strategy | str,
        accept: str = "greedy",
        temperature: float | None = None,
        top_k: int = -1,
        top_p: float = 1.0,
    ) -> StepProgram:
        """An SD step. temperature defaults to 0 for greedy and 1 for sampled or filtered acceptance."""
        s = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
        nodes = (
            Node.make(Op.DRAFT, depth=s.depth, topk=s.topk, verify_tokens=s.verify_tokens),
            Node.make(Op.VERIFY, verify_tokens=s.verify_tokens),
            _accept(accept, s.depth, temperature, top_k, top_p),
            Node.make(Op.COMMIT, depth=s.depth),
        )
        return cls(nodes).verify()

    @classmethod
    def plain_decode(
        cls, accept: str = "greedy", temperature: float | None = None, top_k: int = -1, top_p: float = 1.0
    ) -> StepProgram:
        """A decode step: no DRAFT, VERIFY of the one last token, ACCEPT of depth 0 (the bonus only)."""
        nodes = (
            Node.make(Op.VERIFY, verify_tokens=1),
            _accept(accept, 0, temperature, top_k, top_p),
            Node.make(Op.COMMIT, depth=0),
        )
        return cls(nodes).verify()

    # ---- queries and edits ----------------------------------------------------------------------------

    def node(self, op: Op) -> Node | None:
        """The first node of this op, or None."""
        return next((n for n in self.nodes if n.op == op), None)

    @property
    def strategy(self) -> Strategy | None:
        """The DRAFT node's strategy, None for plain decode."""
        draft = self.node(Op.DRAFT)
        return None if draft is None else Strategy(draft["depth"], draft["topk"], draft["verify_tokens"])

    @property
    def depth(self) -> int:
        """D: the most draft tokens one step can accept (0 for plain decode)."""
        draft = self.node(Op.DRAFT)
        return 0 if draft is None else draft["depth"]

    def edit(self, index: int, **changes: Any) -> StepProgram:
        """A copy with nodes[index].replace(**changes); not verified."""
        nodes = list(self.nodes)
        nodes[index] = nodes[index].replace(**changes)
        return StepProgram(tuple(nodes))

    # ---- verifier -------------------------------------------------------------------------------------

    def verify(self) -> StepProgram:
        """Return self if well formed, else raise IRError naming the first offending node."""
        if not self.nodes:
            raise IRError(0, None, "empty program, expected [DRAFT,] VERIFY, ACCEPT, COMMIT")
        seen: dict[Op, int] = {}
        for i, node in enumerate(self.nodes):
            if not isinstance(node, Node) or not isinstance(node.op, Op):
                raise IRError(i, None, f"not a Node with an Op: {node!r}")
            if node.op in seen:
                raise IRError(i, node, f"duplicate {node.op.name} (first at %{seen[node.op]})")
            later = [op for op in seen if op > node.op]
            if later:
                raise IRError(i, node, f"out of order: {node.op.name} must come before {later[0].name}")
            seen[node.op] = i
            _check_attrs(i, node)
        for required in (Op.VERIFY, Op.ACCEPT, Op.COMMIT):
            if required not in seen:
                # blame the node the missing one should precede, else the last node
                after = [i for i, node in enumerate(self.nodes) if node.op > required]
                if after:
                    raise IRError(after[0], self.nodes[after[0]], f"missing {required.name} before it")
                last = len(self.nodes) - 1
                raise IRError(last, self.nodes[last], f"program ends without a {required.name} node")

        strategy = self._strategy_checked()
        depth = 0 if strategy is None else strategy.depth
        tokens = 1 if strategy is None else strategy.verify_tokens
        for i, node in enumerate(self.nodes):
            if node.op == Op.VERIFY and node["verify_tokens"] != tokens:
                src = f"the DRAFT strategy's {tokens}" if strategy else "1 without a DRAFT"
                raise IRError(i, node, f"verify_tokens={node['verify_tokens']} must equal {src}")
            if node.op in (Op.ACCEPT, Op.COMMIT) and node["depth"] != depth:
                src = f"the DRAFT depth {depth}" if strategy else "0 without a DRAFT"
                raise IRError(i, node, f"depth={node['depth']} must equal {src}")
            if node.op == Op.ACCEPT:
                _check_accept(i, node)
        return self

    def _strategy_checked(self) -> Strategy | None:
        for i, node in enumerate(self.nodes):
            if node.op == Op.DRAFT:
                try:
                    return Strategy(node["depth"], node["topk"], node["verify_tokens"])
                except ValueError as err:
                    raise IRError(i, node, str(err)) from None
        return None

    # ---- shapes ---------------------------------------------------------------------------------------

    def step_inputs(self, bucket: Bucket) -> dict[str, TensorSpec]:
        """Tensors the engine hands the step.

        last_tokens [B]: last emitted token (the tree root), not yet in the KV cache; prefix_lens [B]:
        tokens in the KV cache, so the root sits at position prefix_lens; block_table [B, blocks].
        With a DRAFT also the drafter's catch-up block, its rows p = prefix_lens-D-1 .. prefix_lens-1 (every
        row the previous step's accepted path added, and rows seen before, recomputed): ctx_hidden
        [B, D+1, H] the target hidden state at p, ctx_tokens [B, D+1] the token at p+1 (the last is the
        root, last_tokens), ctx_len [B] how many rows are real, min(prefix_lens, D+1); rows before
        position 0 are padding, and 0 marks a padding sequence. D+1 is the least the step needs: a caller
        may pass a longer block (the engine passes its deepest strategy's, R rows, ctx_len min(prefix_lens,
        R)), so that switching between strategies never leaves the drafter rows behind.
        With sampled acceptance also uniforms [B, D+1, 2] f32 in [0, 1): the acceptance walk's random
        draws at each depth (accept scan, bonus draw), filled on the device so nothing syncs.
        """
        self._check_bucket(bucket)
        B, D, H = bucket.batch_size, self.depth, bucket.hidden_size
        i64 = torch.int64
        specs = {
            "last_tokens": TensorSpec((B,), i64),
            "prefix_lens": TensorSpec((B,), i64),
            "block_table": TensorSpec((B, bucket.max_blocks_per_seq), torch.int32),
        }
        if self.strategy is not None:
            specs["ctx_tokens"] = TensorSpec((B, D + 1), i64)
            specs["ctx_hidden"] = TensorSpec((B, D + 1, H), None)
            specs["ctx_len"] = TensorSpec((B,), i64)
        accept = self.node(Op.ACCEPT)
        if accept is not None and accept.get("mode") in ("sampled", "filtered"):
            specs["uniforms"] = TensorSpec((B, D + 1, 2), torch.float32)
        return specs

    def signature(self, bucket: Bucket) -> dict[Node, NodeSignature]:
        """Every node's input and output tensors for this bucket. B = batch_size, T = verify_tokens
        (1 for plain decode), D = depth (0 for plain decode), K = topk, V = vocab, H = hidden.

        DRAFT makes the `DraftTree` fields (tree.py): tree_tokens, parents, depths, positions [B, T],
        tree_mask [B, T, T], paths [B, T, D+1], children [B, T, K], num_children [B, T].
        VERIFY makes logits [B, T, V] and hidden [B, T, H] (model dtype) for every tree node.
        ACCEPT makes accept_len [B] (accepted draft tokens, 0..D); accepted_tokens [B, D+1] (the accepted
        draft tokens, then the bonus token at index accept_len, -1 after); accepted_nodes [B, D+1] (tree
        node of accepted_tokens[:, i] for i < accept_len, -1 from accept_len on: the bonus has no node);
        bonus [B]; logprobs [B, D+1] f32 (the target's log-prob of each emitted token; entries after
        index accept_len are padding, read only [:accept_len+1]).
        COMMIT keeps the root's KV at position prefix_lens, moves accepted node accepted_nodes[:, i] to
        position prefix_lens + 1 + i, and makes new_prefix_lens [B] = prefix_lens + accept_len + 1 (the
        bonus is the next step's root, not yet in the cache).
        """
        self.verify()
        self._check_bucket(bucket)
        B, T, D = bucket.batch_size, bucket.tokens_per_seq, self.depth
        V, H = bucket.vocab_size, bucket.hidden_size
        made = dict(self.step_inputs(bucket))
        spec = TensorSpec
        i64 = torch.int64
        out: dict[Node, NodeSignature] = {}
        for node in self.nodes:
            if node.op == Op.DRAFT:
                reads = ["last_tokens", "prefix_lens", "ctx_tokens", "ctx_hidden", "ctx_len"]
                makes = {
                    "tree_tokens": spec((B, T), i64),
                    "parents": spec((B, T), i64),
                    "depths": spec((B, T), i64),
                    "positions": spec((B, T), i64),
                    "tree_mask": spec((B, T, T), torch.bool),
                    "paths": spec((B, T, D + 1), i64),
                    "children": spec((B, T, node["topk"]), i64),
                    "num_children": spec((B, T), i64),
                }
            elif node.op == Op.VERIFY:
                tree = ["tree_tokens", "positions", "tree_mask"] if D else ["last_tokens"]
                reads = [*tree, "prefix_lens", "block_table"]
                makes = {"logits": spec((B, T, V), None), "hidden": spec((B, T, H), None)}
            elif node.op == Op.ACCEPT:
                tree = ["tree_tokens", "parents"] if D else []
                draws = ["uniforms"] if node["mode"] != "greedy" else []
                reads = ["logits", *tree, *draws]
                makes = {
                    "accept_len": spec((B,), i64),
                    "accepted_tokens": spec((B, D + 1), i64),
                    "accepted_nodes": spec((B, D + 1), i64),
                    "bonus": spec((B,), i64),
                    "logprobs": spec((B, D + 1), torch.float32),
                }
            else:
                reads = ["accepted_nodes", "accept_len", "prefix_lens", "block_table"]
                makes = {"new_prefix_lens": spec((B,), i64)}
            out[node] = NodeSignature({name: made[name] for name in reads}, makes)
            made.update(makes)
        return out

    def shapes(self, bucket: Bucket) -> dict[Node, dict[str, tuple[int, ...]]]:
        """{node: {tensor name: shape}} over each node's inputs and outputs."""
        return {
            node: {name: s.shape for name, s in (sig.inputs | sig.outputs).items()}
            for node, sig in self.signature(bucket).items()
        }

    def _check_bucket(self, bucket: Bucket) -> None:
        if bucket.strategy != self.strategy:
            raise ValueError(
                f"bucket {bucket} serves strategy {bucket.strategy or 'decode'}, "
                f"the program is {self.strategy or 'decode'}"
            )

    # ---- printing -------------------------------------------------------------------------------------

    def pretty(self, bucket: Bucket | None = None) -> str:
        """One line per node; with a bucket, each node's inputs (<-) and outputs (->) with shapes."""
        if bucket is None:
            return "\n".join(f"%{i} {node}" for i, node in enumerate(self.nodes))

        def tensors(specs: dict[str, TensorSpec]) -> str:
            return " ".join(f"{name}{spec}" for name, spec in specs.items())

        lines = [
            f"StepProgram bucket {bucket}: V={bucket.vocab_size} H={bucket.hidden_size} block_size={bucket.block_size}",
            f"   inputs   {tensors(self.step_inputs(bucket))}",
        ]
        for i, (node, sig) in enumerate(self.signature(bucket).items()):
            lines += [f"%{i} {node}", f"   <- {tensors(sig.inputs)}", f"   -> {tensors(sig.outputs)}"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.pretty()


def _accept(mode: str, depth: int, temperature: float | None, top_k: int, top_p: float) -> Node:
    if temperature is None:
        temperature = 0.0 if mode == "greedy" else 1.0
    return Node.make(Op.ACCEPT, mode=mode, depth=depth, temperature=temperature, top_k=top_k, top_p=top_p)


def _check_attrs(i: int, node: Node) -> None:
    names = [k for k, _ in node.attrs]
    expected = ATTRS[node.op]
    for name in expected:
        if name not in names:
            raise IRError(i, node, f"missing attribute {name!r} (expects {', '.join(expected)})")
    for name in names:
        if name not in expected:
            raise IRError(i, node, f"unknown attribute {name!r} (expects {', '.join(expected)})")
    if len(set(names)) != len(names):
        raise IRError(i, node, "repeated attribute")
    for name in ("depth", "topk", "verify_tokens", "top_k"):
        if name in names and not _is_int(node[name]):
            raise IRError(i, node, f"{name} must be an int, got {node[name]!r}")


def _check_accept(i: int, node: Node) -> None:
    mode, temp, top_k, top_p = node["mode"], node["temperature"], node["top_k"], node["top_p"]
    if mode not in ACCEPT_MODES:
        raise IRError(i, node, f"mode must be one of {ACCEPT_MODES}, got {mode!r}")
    if not _is_real(temp) or temp < 0:
        raise IRError(i, node, f"temperature must be a finite number >= 0, got {temp!r}")
    if mode == "greedy" and temp != 0:
        raise IRError(i, node, f"greedy acceptance needs temperature=0, got {temp}")
    if mode != "greedy" and temp == 0:
        raise IRError(i, node, f"{mode} acceptance needs temperature > 0 (use mode=greedy for 0)")
    if top_k == 0 or top_k < -1:
        raise IRError(i, node, f"top_k must be -1 (off) or >= 1, got {top_k}")
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise IRError(i, node, f"top_p must be in (0, 1], got {top_p!r}")
