"""Architecture description of a Llama-family target, read from a HF `config.json`.

Covers Llama 2/3 (llama3 and linear RoPE scaling), Qwen2/Qwen2.5 (bias on q/k/v) and SmolLM2 (Llama with
tied embeddings). Both the older `rope_theta` + `rope_scaling` keys and the newer `rope_parameters` are read.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this runtime does not implement."""


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 and Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias only
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def architecture(self) -> str:
        return SUPPORTED[self.model_type]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ArchConfig:
        mt = cfg.get("model_type")
        if mt not in SUPPORTED:
            raise UnsupportedModelError(
                f"{source}: model_type {mt!r} is not supported (supported: {', '.join(sorted(SUPPORTED))})"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: sliding-window attention is not supported")
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = dict(cfg.get("rope_scaling") or rope or {})
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        if rtype not in ROPE_TYPES:
            raise UnsupportedModelError(f"{source}: rope type {rtype!r} is not supported (supported: {ROPE_TYPES})")
        scaling = None if rtype == "default" else {**scaling, "rope_type": rtype}
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=mt,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or attn_bias,
            o_bias=mt == "llama" and attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ArchConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf(cfg, source=str(path))

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers and serving engines read back as the same model."""
        d = asdict(self)
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        out = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
            "mlp_bias",
            "bos_token_id",
        ):
            out[k] = d[k]
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
        return out


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] in fp32, with linear or llama3 scaling applied."""
    d = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = arch.rope_scaling
    if s is None:
        return inv.float()
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return (inv / factor).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend in between
    old_ctx = float(s["original_max_position_embeddings"])
    lo, hi = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    wavelen = 2 * math.pi / inv
    smooth = ((old_ctx / wavelen) - lo) / (hi - lo)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_ctx / lo, inv / factor, blended)
    out = torch.where(wavelen < old_ctx / hi, inv, out)
    return out.float()


def rotate_pair(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k [..., T, H, D] at positions [..., T]; rotate-half convention (HF layout)."""
    freqs = positions.unsqueeze(-1).float() * inv_freq  # [..., T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)  # [..., T, 1, D]
    cos, sin = emb.cos(), emb.sin()

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    return rot(q), rot(k)
