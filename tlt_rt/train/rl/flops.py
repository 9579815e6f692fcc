"""What a learner update computes, in model FLOPs, and the device's peak: tokens/s and MFU.

Model FLOPs count the work the update needs, not what the kernels ran (recomputation is not credited), as
MFU is usually reported (PaLM appendix B; torchtitan's metrics): 6 x matmul parameters per token forward +
backward, causal attention 6 x L^2 x (heads x head_dim) per layer per sequence of length L, and the LM head
6 x hidden x vocab per response token (the learner projects only those rows).
"""

from __future__ import annotations

import torch

from tlt_rt.models.arch import ArchConfig

# dense bf16 tensor-core peaks, FLOP/s (vendor data sheets; SXM parts)
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


def layer_matmul_params(a: ArchConfig) -> int:
    """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down)."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    return a.hidden_size * (2 * q + 2 * kv) + 3 * a.hidden_size * a.intermediate_size


def update_flops(a: ArchConfig, lengths: list[int], response_tokens: int) -> float:
    """Model FLOPs of forward + backward over sequences of `lengths` tokens (padding not counted), with log-probs
    taken at `response_tokens` positions."""
    tokens = sum(lengths)
    dense = 6.0 * a.num_hidden_layers * layer_matmul_params(a) * tokens
    attn = 6.0 * a.num_hidden_layers * a.num_attention_heads * a.head_dim * sum(n * n for n in lengths) / 2
    head = 6.0 * a.hidden_size * a.vocab_size * response_tokens
    return dense + attn + head


def peak_flops(device: torch.device | str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, None where unknown (a CPU, an unlisted GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)
