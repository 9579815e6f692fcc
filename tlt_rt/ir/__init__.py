"""What a speculative step is: strategies and buckets, the step program, and the draft tree."""

from .program import ACCEPT_MODES, ATTRS, IRError, Node, NodeSignature, Op, StepProgram, TensorSpec
from .strategy import Bucket, Strategy, batch_buckets, bucket_for, max_verify_tokens
from .tree import Candidates, DraftTree, build_tree, expand, level_bounds, select_frontier

__all__ = [
    "ACCEPT_MODES",
    "ATTRS",
    "Bucket",
    "Candidates",
    "DraftTree",
    "IRError",
    "Node",
    "NodeSignature",
    "Op",
    "StepProgram",
    "Strategy",
    "TensorSpec",
    "batch_buckets",
    "bucket_for",
    "build_tree",
    "expand",
    "level_bounds",
    "max_verify_tokens",
    "select_frontier",
]
