"""Write / read a drafter as an EAGLE(-2) draft-model folder that serving engines load.

Layout (SGLang `python/sglang/srt/models/llama_eagle.py` and `qwen2_eagle.py`, which follow the original
EAGLE `cnets.py`; vLLM's EAGLE-1 Llama model reads the same names):

    config.json         the target's config with "architectures": ["LlamaForCausalLMEagle"] (Llama) or
                        ["Qwen2ForCausalLMEagle"] (Qwen2), "num_hidden_layers": 1
    model.safetensors   fc.weight [H, 2H], fc.bias [H]   (fc input = concat(embedding, feature), in that order)
                        layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v .bias for Qwen2 / attention_bias)
                        layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight
                        (no layers.0.input_layernorm: the engines replace it with the identity)
                        embed_tokens.weight (optional, as original EAGLE checkpoints carry it; engines
                        share the target's), lm_head.weight (optional; SGLang skips it and shares the target's)
    hot_token_map.pt    only with a reduced draft vocabulary: the int64 target ids of the draft vocabulary,
                        the file SGLang takes as `--speculative-token-map`

Names carry no "model." prefix: the engines' `load_weights` add it. The engines feed the target's
hidden state after its final norm and apply no norm before the LM head, which is the drafter's own
convention (see tlt_rt.models.drafter), so an exported drafter drafts the same tokens there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM

EAGLE_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
TOKEN_MAP = "hot_token_map.pt"
_SHARED = ("embed_tokens.weight", "lm_head.weight")


def export_eagle(
    drafter: Drafter,
    folder: str | Path,
    include_embed: bool = True,
    include_lm_head: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `drafter` into `folder` as an EAGLE draft model (config.json + model.safetensors)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arch = drafter.arch
    dtype = dtype or drafter.fc.weight.dtype
    cfg = arch.to_hf()
    cfg.update(
        architectures=[EAGLE_ARCHITECTURES[arch.model_type]],
        num_hidden_layers=1,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    state = {k: v for k, v in drafter.state_dict().items() if k != "d2t"}
    if include_embed:
        state["embed_tokens.weight"] = drafter.embed_tokens.weight
    if include_lm_head:
        state["lm_head.weight"] = drafter.lm_head.weight
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    if cfg.get("tie_word_embeddings") and include_embed and include_lm_head:
        state.pop("lm_head.weight")  # tied: the embedding is the head
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    token_map = folder / TOKEN_MAP
    if drafter.d2t is not None:
        torch.save(drafter.d2t.detach().cpu(), token_map)
    elif token_map.exists():
        token_map.unlink()
    return folder


def load_eagle(
    folder: str | Path, target: CausalLM, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> Drafter:
    """Build a Drafter bound to `target` from an EAGLE draft folder (ours or one in the same layout)."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (not an EAGLE draft model folder)")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    if not set(archs) & set(EAGLE_ARCHITECTURES.values()):
        raise ValueError(
            f"{cfg_path}: architectures {archs} name no EAGLE draft model "
            f"(expected one of {sorted(EAGLE_ARCHITECTURES.values())})"
        )
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{cfg_path}: only one-layer drafters are supported, got {cfg['num_hidden_layers']}")
    arch = ArchConfig.from_hf({**cfg, "num_hidden_layers": 1}, source=str(cfg_path))
    if arch.hidden_size != target.arch.hidden_size or arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"{cfg_path}: hidden_size/vocab_size {arch.hidden_size}/{arch.vocab_size} do not match the "
            f"target's {target.arch.hidden_size}/{target.arch.vocab_size}"
        )
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{folder}: no model.safetensors")
    device = torch.device(device) if device is not None else target.lm_head.weight.device
    dtype = dtype or target.lm_head.weight.dtype
    drafter = Drafter(arch, target).to(device, dtype)
    params = drafter.state_dict()
    seen = set()
    with safe_open(str(weights), framework="pt") as st:
        for name in st.keys():
            key = name.removeprefix("model.")
            if key in _SHARED or key.endswith("rotary_emb.inv_freq"):
                continue  # the target's own modules are used
            if key not in params:
                raise ValueError(f"{weights}: tensor {name!r} does not belong to an EAGLE drafter")
            t = st.get_tensor(name)
            if tuple(t.shape) != tuple(params[key].shape):
                raise ValueError(
                    f"{weights}: tensor {name!r} has shape {tuple(t.shape)}, "
                    f"the config implies {tuple(params[key].shape)}"
                )
            with torch.no_grad():
                params[key].copy_(t)
            seen.add(key)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"{weights}: missing tensor(s) {', '.join(missing)}")
    token_map = folder / TOKEN_MAP
    if token_map.is_file():
        drafter.set_draft_vocab(torch.as_tensor(torch.load(token_map, weights_only=True)))
    return drafter.eval()
