"""Model shapes by name, as `ArchConfig` keyword arguments, so nothing needs a download to know one.

`KNOWN_SHAPES` are whole published models (each model's config.json, or the header of the GGUF that
`python -m tlt_rt.models.fetch` brings): the dry run's `model.arch` takes them, and the benchmarks build
random weights of them. `RANK_SHAPES` are one tensor-parallel rank's slice of such a model, which a
single-GPU benchmark times as that rank's share of a step. `SHAPES` holds both.

Pure data, no imports from the package: the dry run, the registry and the benchmarks all read it.
"""

from __future__ import annotations

KNOWN_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       qkv_bias=True, rope_theta=1e6, max_position_embeddings=32768),
    "qwen2.5-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                        qkv_bias=True, rope_theta=1e6, max_position_embeddings=32768),
    "llama3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                       rope_theta=5e5, max_position_embeddings=131072),
    # the GGUFs that `python -m tlt_rt.models.fetch` brings (registry.py), as their headers give them: both
    # models are published with tied embeddings, but each GGUF carries its own output.weight, so they load untied
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                               qkv_bias=True, tie_word_embeddings=False, max_position_embeddings=32768,
                               rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=151643, eos_token_ids=(151645,)),
    "qwen2.5-coder-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                               qkv_bias=True, tie_word_embeddings=False, max_position_embeddings=32768,
                               rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=151643, eos_token_ids=(151645,)),
}  # fmt: skip


def tp_rank_shape(shape: dict, world: int) -> dict:
    """One rank's slice of `shape` at tensor parallelism `world`: its query and KV heads, MLP columns and
    vocabulary rows divided by `world`, the hidden size whole (as `shard_for_tp` cuts a model)."""
    sliced = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    return {**shape, **{k: shape[k] // world for k in sliced}}


# a rank's step time is a TP step's compute and HBM traffic per GPU, without the two all-reduces per layer
RANK_SHAPES: dict[str, dict] = {"llama-70b-tp8-rank": tp_rank_shape(KNOWN_SHAPES["llama3-70b"], 8)}

SHAPES: dict[str, dict] = {**KNOWN_SHAPES, **RANK_SHAPES}
