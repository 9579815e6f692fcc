"""Target models (Llama family) and their loading."""

from tlt_rt.models.arch import ArchConfig, UnsupportedModelError
from tlt_rt.models.attention import AttentionBackend, AttnMetadata, TorchAttention
from tlt_rt.models.llama import CausalLM, KVCache, ModelOutput
from tlt_rt.models.loader import load_target, save_target

__all__ = [
    "ArchConfig",
    "AttentionBackend",
    "AttnMetadata",
    "CausalLM",
    "KVCache",
    "ModelOutput",
    "TorchAttention",
    "UnsupportedModelError",
    "load_target",
    "save_target",
]
