"""A decode step as a program: the drafter's catch-up and levels, the rerank, verify, accept, commit, output.

One node type (`Node`: an `Op` plus attributes, edited through `replace`) in a straight-line `StepProgram`,
ops in the order of the enum. Data flows by tensor name: each node reads named tensors made by earlier nodes
or given to the step and makes new ones; `ir.signature` gives every name's shape and dtype, the contract
between the IR, codegen and the engine. Three kinds of program, each built and verified here:

    speculative  CATCHUP  LEVEL x (depth-1)  RERANK  VERIFY  ACCEPT  COMMIT  OUTPUT
    plain        ROOT                                VERIFY  ACCEPT  COMMIT  OUTPUT
    first draw                                               ACCEPT            (depth 0, over given logits)

Plain decoding is a speculative step whose tree is its root alone: VERIFY sends one token per sequence and
ACCEPT of depth 0 draws the bonus token, so acceptance, log-probs and the KV commit have one path for every
token, the first one after a prefill included (the first-draw program). Sampling settings are per-row
inputs of the step (temperature, top_k, top_p); ACCEPT's `mode` picks the walk: greedy (argmax), sampled
(the exact rejection walk over the temperature-scaled distribution) or filtered (the same over the top-k /
top-p filtered one). A program of a mode serves every row its mode covers: greedy rows inside a sampled
step, unfiltered rows inside a filtered one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from . import signature as _signature
from .signature import NodeSignature, TensorSpec
from .strategy import Bucket, Strategy

__all__ = ["ACCEPT_MODES", "ATTRS", "IRError", "Node", "NodeSignature", "Op", "StepProgram", "TensorSpec"]


class Op(IntEnum):
    """Node kinds, in the only order a program may hold them (LEVEL may repeat, one node per draft level)."""

    CATCHUP = 0  # the drafter over its catch-up block; the root's K best children: level 1 of the draft
    LEVEL = 1  # one more draft level: the drafter over the frontier, its children, the next frontier
    RERANK = 2  # every candidate -> the verify tree (the best verify_tokens - 1 under the root)
    ROOT = 3  # plain decoding's tree: the root alone
    VERIFY = 4  # the target over the tree
    ACCEPT = 5  # the acceptance walk: accepted tokens, the bonus token, their log-probs
    COMMIT = 6  # the accepted path's K/V moved into place
    OUTPUT = 7  # the hidden rows of the accepted path, the catch-up windows moved on, the host's results packed


class IRError(ValueError):
    """An ill-formed StepProgram; the message starts with the offending node, e.g. "%2 ACCEPT: ..."."""

    def __init__(self, index: int, node: Node | None, message: str) -> None:
        self.index, self.node = index, node
        name = node.op.name if node is not None and isinstance(node.op, Op) else "?"
        super().__init__(f"%{index} {name}: {message}")


# the attributes each op carries, in print order
ATTRS: dict[Op, tuple[str, ...]] = {
    Op.CATCHUP: ("rows", "topk"),
    Op.LEVEL: ("level", "topk"),
    Op.RERANK: ("depth", "topk", "verify_tokens"),
    Op.ROOT: (),
    Op.VERIFY: ("verify_tokens",),
    Op.ACCEPT: ("mode", "depth"),
    Op.COMMIT: ("depth",),
    Op.OUTPUT: ("depth", "rows"),
}
ACCEPT_MODES = ("greedy", "sampled", "filtered")
_STEP = (Op.VERIFY, Op.ACCEPT, Op.COMMIT, Op.OUTPUT)  # what every decode step holds after its tree


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
class StepProgram:
    """A straight-line program of `Node`s. Build with `speculative`, `plain_decode` or `first_draw` (each
    verified); programs edited by hand are checked with `verify()`."""

    nodes: tuple[Node, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))

    # ---- builders -------------------------------------------------------------------------------------

    @classmethod
    def speculative(cls, strategy: Strategy | str, accept: str = "greedy", rows: int | None = None) -> StepProgram:
        """A speculative step of `strategy`. rows: the drafter's catch-up block (R >= depth + 1, the default);
        an engine passes its deepest strategy's, so that switching strategies never leaves the drafter behind."""
        s = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
        r = s.depth + 1 if rows is None else rows
        nodes = (
            Node.make(Op.CATCHUP, rows=r, topk=s.topk),
            *(Node.make(Op.LEVEL, level=d, topk=s.topk) for d in range(2, s.depth + 1)),
            Node.make(Op.RERANK, depth=s.depth, topk=s.topk, verify_tokens=s.verify_tokens),
            Node.make(Op.VERIFY, verify_tokens=s.verify_tokens),
            Node.make(Op.ACCEPT, mode=accept, depth=s.depth),
            Node.make(Op.COMMIT, depth=s.depth),
            Node.make(Op.OUTPUT, depth=s.depth, rows=r),
        )
        return cls(nodes).verify()

    @classmethod
    def plain_decode(cls, accept: str = "greedy") -> StepProgram:
        """A plain decode step: the root alone verified (one token per sequence), the bonus drawn."""
        nodes = (
            Node.make(Op.ROOT),
            Node.make(Op.VERIFY, verify_tokens=1),
            Node.make(Op.ACCEPT, mode=accept, depth=0),
            Node.make(Op.COMMIT, depth=0),
            Node.make(Op.OUTPUT, depth=0, rows=0),
        )
        return cls(nodes).verify()

    @classmethod
    def first_draw(cls, accept: str = "greedy") -> StepProgram:
        """A sample's first token after its prompt's prefill: ACCEPT of depth 0 over the prefill's logits."""
        return cls((Node.make(Op.ACCEPT, mode=accept, depth=0),)).verify()

    # ---- queries and edits ----------------------------------------------------------------------------

    def node(self, op: Op) -> Node | None:
        """The first node of this op, or None."""
        return next((n for n in self.nodes if n.op == op), None)

    @property
    def strategy(self) -> Strategy | None:
        """The RERANK node's strategy, None for plain decoding and a first draw."""
        rerank = self.node(Op.RERANK)
        return None if rerank is None else Strategy(rerank["depth"], rerank["topk"], rerank["verify_tokens"])

    @property
    def depth(self) -> int:
        """D: the most draft tokens one step can accept (0 for plain decoding)."""
        rerank = self.node(Op.RERANK)
        return 0 if rerank is None else rerank["depth"]

    @property
    def rows(self) -> int:
        """R: rows of the drafter's catch-up block (0 without a draft)."""
        catchup = self.node(Op.CATCHUP)
        return 0 if catchup is None else catchup["rows"]

    @property
    def is_draw(self) -> bool:
        """A first-draw program: ACCEPT alone, over logits given to it."""
        return self.node(Op.VERIFY) is None

    def edit(self, index: int, **changes: Any) -> StepProgram:
        """A copy with nodes[index].replace(**changes); not verified."""
        nodes = list(self.nodes)
        nodes[index] = nodes[index].replace(**changes)
        return StepProgram(tuple(nodes))

    # ---- verifier -------------------------------------------------------------------------------------

    def verify(self) -> StepProgram:
        """Return self if well formed, else raise IRError naming the first offending node."""
        if not self.nodes:
            raise IRError(0, None, "empty program, expected a decode step or a first draw")
        seen: dict[Op, int] = {}
        for i, node in enumerate(self.nodes):
            if not isinstance(node, Node) or not isinstance(node.op, Op):
                raise IRError(i, None, f"not a Node with an Op: {node!r}")
            if node.op in seen and node.op != Op.LEVEL:
                raise IRError(i, node, f"duplicate {node.op.name} (first at %{seen[node.op]})")
            later = [op for op in seen if op > node.op]
            if later:
                raise IRError(i, node, f"out of order: {node.op.name} must come before {later[0].name}")
            seen.setdefault(node.op, i)
            _check_attrs(i, node)
        if set(seen) == {Op.ACCEPT}:  # a first draw
            if self.nodes[0]["depth"] != 0:
                raise IRError(0, self.nodes[0], "a first draw (ACCEPT alone) has depth 0")
            return self._check_accept()
        self._check_required(seen)
        depth, topk, tokens, rows = self._tree_checked(seen)
        for i, node in enumerate(self.nodes):
            if node.op == Op.VERIFY and node["verify_tokens"] != tokens:
                src = "the RERANK's" if depth else "1 (plain decoding)"
                raise IRError(i, node, f"verify_tokens={node['verify_tokens']} must equal {src} {tokens}")
            if node.op in (Op.ACCEPT, Op.COMMIT, Op.OUTPUT) and node["depth"] != depth:
                src = "the RERANK's depth" if depth else "0 (plain decoding)"
                raise IRError(i, node, f"depth={node['depth']} must equal {src} {depth}")
            if node.op in (Op.LEVEL, Op.CATCHUP) and node["topk"] != topk:
                raise IRError(i, node, f"topk={node['topk']} must equal the RERANK's {topk}")
            if node.op == Op.OUTPUT and node["rows"] != rows:
                raise IRError(i, node, f"rows={node['rows']} must equal the CATCHUP's {rows}")
        return self._check_accept()

    def _check_required(self, seen: dict[Op, int]) -> None:
        draft = [op for op in (Op.CATCHUP, Op.LEVEL, Op.RERANK) if op in seen]
        if Op.ROOT in seen and draft:
            raise IRError(seen[Op.ROOT], self.nodes[seen[Op.ROOT]], f"a ROOT tree with a draft ({draft[0].name})")
        tree = (Op.ROOT,) if Op.ROOT in seen or not draft else (Op.CATCHUP, Op.RERANK)
        for required in (*tree, *_STEP):
            if required not in seen:
                # blame the node the missing one should precede, else the last node
                after = [i for i, node in enumerate(self.nodes) if node.op > required]
                if after:
                    raise IRError(after[0], self.nodes[after[0]], f"missing {required.name} before it")
                last = len(self.nodes) - 1
                raise IRError(last, self.nodes[last], f"the program ends without {required.name}")

    def _tree_checked(self, seen: dict[Op, int]) -> tuple[int, int, int, int]:
        """(depth, topk, verify_tokens, catch-up rows) of the tree; (0, 0, 1, 0) for plain decoding."""
        if Op.ROOT in seen:
            return 0, 0, 1, 0
        i = seen[Op.RERANK]
        rerank = self.nodes[i]
        try:
            s = Strategy(rerank["depth"], rerank["topk"], rerank["verify_tokens"])
        except ValueError as err:
            raise IRError(i, rerank, str(err)) from None
        levels = [(j, n) for j, n in enumerate(self.nodes) if n.op == Op.LEVEL]
        for want, (j, node) in enumerate(levels, start=2):
            if node["level"] != want:
                raise IRError(j, node, f"level={node['level']}: levels run 2, 3, ... in order, expected {want}")
        if len(levels) != s.depth - 1:
            raise IRError(i, rerank, f"depth={s.depth} needs {s.depth - 1} LEVEL nodes, the program has {len(levels)}")
        c = seen[Op.CATCHUP]
        rows = self.nodes[c]["rows"]
        if not _is_int(rows) or rows < s.depth + 1:
            raise IRError(c, self.nodes[c], f"rows={rows!r} must be an int >= depth + 1 = {s.depth + 1}")
        return s.depth, s.topk, s.verify_tokens, rows

    def _check_accept(self) -> StepProgram:
        i = next(j for j, n in enumerate(self.nodes) if n.op == Op.ACCEPT)
        if self.nodes[i]["mode"] not in ACCEPT_MODES:
            raise IRError(i, self.nodes[i], f"mode must be one of {ACCEPT_MODES}, got {self.nodes[i]['mode']!r}")
        return self

    # ---- shapes and printing (ir/signature.py) ---------------------------------------------------------

    def step_inputs(self, bucket: Bucket) -> dict[str, TensorSpec]:
        """Tensors the engine hands the step (`ir.signature.step_inputs`)."""
        self._check_bucket(bucket)
        return _signature.step_inputs(self.nodes, bucket)

    def signature(self, bucket: Bucket) -> dict[Node, NodeSignature]:
        """Every node's input and output tensors for this bucket (`ir.signature.signature`)."""
        self.verify()
        self._check_bucket(bucket)
        return _signature.signature(self.nodes, bucket)

    def shapes(self, bucket: Bucket) -> dict[Node, dict[str, tuple[int, ...]]]:
        """{node: {tensor name: shape}} over each node's inputs and outputs."""
        return {
            node: {name: s.shape for name, s in (sig.inputs | sig.outputs).items()}
            for node, sig in self.signature(bucket).items()
        }

    def _check_bucket(self, bucket: Bucket) -> None:
        if not self.is_draw and bucket.strategy != self.strategy:
            raise ValueError(
                f"bucket {bucket} serves strategy {bucket.strategy or 'decode'}, "
                f"the program is {self.strategy or 'decode'}"
            )

    def pretty(self, bucket: Bucket | None = None) -> str:
        """One line per node; with a bucket, each node's inputs (<-) and outputs (->) with shapes."""
        if bucket is None:
            return "\n".join(f"%{i} {node}" for i, node in enumerate(self.nodes))
        return _signature.pretty(self.nodes, self.signature(bucket), self.step_inputs(bucket), bucket)

    def __str__(self) -> str:
        return self.pretty()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_attrs(i: int, node: Node) -> None:
    names = [k for k, _ in node.attrs]
    expected = ATTRS[node.op]
    for name in expected:
        if name not in names:
            raise IRError(i, node, f"missing attribute {name!r} (expects {', '.join(expected)})")
    for name in names:
        if name not in expected:
            raise IRError(i, node, f"unknown attribute {name!r} (expects {', '.join(expected) or 'none'})")
    if len(set(names)) != len(names):
        raise IRError(i, node, "repeated attribute")
    for name in ("depth", "topk", "verify_tokens", "rows", "level"):
        if name in names and not _is_int(node[name]):
            raise IRError(i, node, f"{name} must be an int, got {node[name]!r}")
