"""A tiny random target with its drafter, a random paged layout, drafter rows (the drafter tests' set-up)."""

from __future__ import annotations

import torch

from tlt_rt.models import ArchConfig, AttnMetadata, CausalLM
from tlt_rt.models.drafter import Drafter

V, H = 97, 64


def tiny_arch(model_type: str = "llama", **kw) -> ArchConfig:
    base = dict(
        model_type=model_type,
        vocab_size=V,
        hidden_size=H,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        qkv_bias=model_type == "qwen2",
    )
    return ArchConfig(**{**base, **kw})


def tiny_pair(model_type: str = "llama", seed: int = 0, **kw) -> tuple[CausalLM, Drafter]:
    torch.manual_seed(seed)
    target = CausalLM(tiny_arch(model_type, **kw)).eval()
    drafter = Drafter(target.arch, target).eval()
    with torch.no_grad():
        for p in [*target.parameters(), *drafter.parameters()]:
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)  # norms and biases non-trivial too
    return target, drafter


class Pager:
    """Each sequence gets a random set of blocks; slots for cache positions."""

    def __init__(self, num_seqs: int, max_len: int, block_size: int, gen: torch.Generator):
        self.bs = block_size
        per_seq = -(-max_len // block_size)
        self.num_blocks = num_seqs * per_seq + 3
        self.tables = torch.randperm(self.num_blocks, generator=gen)[: num_seqs * per_seq].view(num_seqs, -1).int()

    def slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        return self.tables[seq, positions // self.bs].long() * self.bs + positions % self.bs

    def meta(self, q_lens, seq_lens, slots, mode, tree_mask=None) -> AttnMetadata:
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        return AttnMetadata(
            mode,
            cu,
            torch.tensor(seq_lens, dtype=torch.int32),
            self.tables[: len(q_lens)],
            torch.cat(slots),
            max(q_lens),
            tree_mask,
        )


def rows(target: CausalLM, drafter: Drafter, n: int, gen: torch.Generator):
    """Drafter rows of a random sequence of n+1 tokens: ids x_{t+1} [n] and features f_t [n, H]."""
    seq = torch.randint(0, V, (n + 1,), generator=gen)
    with torch.no_grad():
        feats = drafter.features(target(seq[None]).hidden[0])
    return seq[1:], feats[:-1]
