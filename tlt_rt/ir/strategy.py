"""What one speculative step drafts (`Strategy`) and the static shapes a compiled variant serves (`Bucket`)."""

from __future__ import annotations

from dataclasses import dataclass


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a depth is a bug, not a 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


def max_verify_tokens(depth: int, topk: int) -> int:
    """Tree nodes an EAGLE-2 draft of this depth and top-k can offer, root included.

    The first step expands the root into `topk` children; each later step expands the `topk` best
    frontier nodes into `topk` children each, so it adds topk*topk candidates.
    """
    return 1 + topk + (depth - 1) * topk * topk


@dataclass(frozen=True)
class Strategy:
    """A speculative strategy, written `DEPTH_TOPK_VERIFYTOKENS` (e.g. "8_4_48")."""

    depth: int
    """Draft steps, so the longest draft path; at most `depth` draft tokens can be accepted per step."""
    topk: int
    """Branching per draft step: children per expanded node and frontier nodes expanded per later step."""
    verify_tokens: int
    """Tree nodes sent to the target for verification, the root (last emitted token) included."""

    def __post_init__(self) -> None:
        _check_int("Strategy", "depth", self.depth, 1)
        _check_int("Strategy", "topk", self.topk, 1)
        _check_int("Strategy", "verify_tokens", self.verify_tokens, 2)
        limit = max_verify_tokens(self.depth, self.topk)
        if self.verify_tokens > limit:
            raise ValueError(
                f"Strategy.verify_tokens must be <= {limit} (1 root + topk + (depth-1)*topk^2 candidates "
                f"for depth={self.depth}, topk={self.topk}), got {self.verify_tokens}"
            )

    @property
    def num_candidates(self) -> int:
        """Draft candidates the drafter produces, root excluded: topk + (depth-1)*topk^2."""
        return max_verify_tokens(self.depth, self.topk) - 1

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """Parse "DEPTH_TOPK_VERIFYTOKENS", e.g. "8_4_48"; ValueError names the bad field."""
        parts = text.strip().split("_")
        if len(parts) != 3:
            raise ValueError(
                f"strategy {text!r} must look like DEPTH_TOPK_VERIFYTOKENS (depth, topk, verify_tokens), e.g. '8_4_48'"
            )
        values = []
        for name, part in zip(("depth", "topk", "verify_tokens"), parts, strict=True):
            if not part.isdigit():
                raise ValueError(f"strategy {text!r}: {name} must be a positive integer, got {part!r}")
            values.append(int(part))
        return cls(*values)

    def __str__(self) -> str:
        name = self.__dict__.get("_name")  # cached: the SD policy names strategies on every step
        if name is None:
            name = self.__dict__["_name"] = f"{self.depth}_{self.topk}_{self.verify_tokens}"
        return name


def scratch_tokens(strategy: Strategy) -> int:
    """KV-cache positions past a sequence's cached tokens L that a step of `strategy` writes: the verify tree at
    [L, L+T) or the drafter's level scratch (K rows a level from L on), whichever is longer. The accepted path
    is then moved to [L+1, L+1+a] (the COMMIT node) and the bonus token becomes the next root."""
    return max(strategy.verify_tokens, (strategy.depth - 1) * strategy.topk)


@dataclass(frozen=True)
class Bucket:
    """The static shapes one compiled (CUDA-graph captured) step variant serves.

    `vocab_size` and `hidden_size` are model constants, identical across the buckets of one model;
    they live here anyway so that a bucket alone sizes every static buffer of a step
    (logits [B, T, V], hidden [B, T, H]) and `StepProgram.shapes(bucket)` needs nothing else.
    """

    batch_size: int
    """Padded batch size B; a live batch is padded up to it (see `bucket_for`)."""
    strategy: Strategy | None
    """The speculative strategy, or None for plain decode (one token per sequence)."""
    max_blocks_per_seq: int
    """Static width of the block table [B, max_blocks_per_seq]."""
    block_size: int
    """Tokens per KV-cache block."""
    vocab_size: int
    """V, the last dim of the target's logits."""
    hidden_size: int
    """H, the target's hidden rows the drafter reads (its fused features where it fuses several layers)."""
    draft_hidden_size: int = 0
    """Hd, the drafter's own hidden size (0: H)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_blocks_per_seq", "block_size", "vocab_size", "hidden_size"):
            _check_int("Bucket", name, getattr(self, name), 1)
        _check_int("Bucket", "draft_hidden_size", self.draft_hidden_size, 0)
        if self.strategy is not None and not isinstance(self.strategy, Strategy):
            raise ValueError(f"Bucket.strategy must be a Strategy or None, got {self.strategy!r}")

    @property
    def draft_hidden(self) -> int:
        return self.draft_hidden_size or self.hidden_size

    @property
    def tokens_per_seq(self) -> int:
        """Tokens each sequence sends to the target per step: verify_tokens, or 1 for plain decode."""
        return 1 if self.strategy is None else self.strategy.verify_tokens

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the block table can address."""
        return self.max_blocks_per_seq * self.block_size

    def __str__(self) -> str:
        return f"b{self.batch_size}/{self.strategy or 'decode'}"


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, ..., max_batch.

    Doubling up to 8, then steps of half the current power of two (at least 8), so padding never wastes
    more than about a third of a batch; `max_batch` itself is always the last bucket.
    """
    _check_int("batch_buckets", "max_batch", max_batch, 1)
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        if n < 8:
            n *= 2
        else:
            n += max(8, (1 << (n.bit_length() - 1)) // 2)
    sizes.append(max_batch)
    return sizes


def bucket_for(batch: int, buckets: list[int] | tuple[int, ...]) -> int:
    """Smallest bucket >= batch; ValueError if batch exceeds every bucket (the caller runs eager)."""
    _check_int("bucket_for", "batch", batch, 1)
    fitting = [b for b in buckets if b >= batch]
    if not fitting:
        raise ValueError(f"bucket_for: batch {batch} exceeds the largest bucket {max(buckets, default=None)}")
    return min(fitting)
