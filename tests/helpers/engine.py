"""A tiny random target and drafter, and an engine over them (the rollout tests' set-up)."""

from __future__ import annotations

import torch

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM
from tlt_rt.rollout import Engine

TINY = ArchConfig(
    model_type="llama",
    vocab_size=12,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    eos_token_ids=(11,),
)


def tiny_pair(seed: int = 0, scale: float = 1.0):
    torch.manual_seed(seed)
    target = CausalLM(TINY).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(scale)
    drafter = Drafter(TINY, target).eval()
    return target, drafter


def make_engine(speculative="on", strategies=("3_3_8", "4_2_6"), seed=0, **kw):
    target, drafter = tiny_pair(seed, kw.pop("scale", 4.0))
    return Engine(
        target,
        drafter=drafter if speculative != "off" else None,
        speculative=speculative,
        strategies=strategies,
        block_size=kw.pop("block_size", 4),
        **kw,
    )


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1], [3], [2, 2, 2, 2, 2]]


def count_calls(monkeypatch, targets, counts=lambda kwargs: 1) -> dict:
    """Wrap each (module, function name, key) of `targets` so that every call adds counts(its keyword arguments)
    to the returned dict's entry `key`, then runs the real function: which kernels a run went through."""
    seen = dict.fromkeys((key for _, _, key in targets), 0)
    for mod, name, key in targets:
        real = getattr(mod, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            seen[_key] += counts(kwargs)
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    return seen
