"""The target model's section of the config (`model.`): what to load, in which dtype, where."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tlt_rt.options import check, check_min, option, register

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@register
@dataclasses.dataclass
class ModelConfig:
    path: str = option(
        "smollm2",
        help="Target (policy) model: a Hugging Face folder (config.json + safetensors), a .gguf file, "
        "'smollm2' for the embedded SmolLM2-135M that the CPU default trains, or a registered name that "
        "`python -m tlt_rt.models.fetch NAME` fetched (--list shows them; e.g. qwen2.5-coder-1.5b-instruct).",
    )
    dtype: Dtype = option(
        "auto",
        help="Weights and activations dtype. 'auto' = float32 on CPU (where greedy speculative decoding "
        "is checked token for token) and bfloat16 on CUDA.",
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", help="Where rollout engines run the model; 'auto' = cuda when available, else cpu."
    )
    max_context: int = option(
        2048,
        help="Most tokens (prompt + response) one sequence may hold; sizes the KV cache and positions. "
        "Prompts that leave no room for a response are rejected, not truncated.",
    )

    arch: str | None = option(
        None,
        help="Known model shape for the --dry-run placement plan, used when model.path is not on this machine "
        "(smollm2-135m, qwen2.5-7b, qwen2.5-32b, llama3-70b, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b); "
        "model.path/config.json or a .gguf file's header wins when present.",
    )

    def __post_init__(self) -> None:
        check(bool(self.path.strip()), "path", "must not be empty")
        check_min(self, "max_context", 2)
