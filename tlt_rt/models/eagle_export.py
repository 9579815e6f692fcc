"""Write / read a drafter as an EAGLE(-2) draft-model folder that serving engines load; find a run's drafter.

Two layouts, one per engine (each read from the engine's own loader; EAGLE-3 fields are not written: our
drafter is EAGLE-1/2-shaped, one feature of width H in, fc 2H -> H, no fused low/mid/high features):

`format="sglang"` (SGLang `python/sglang/srt/models/llama_eagle.py` and `qwen2_eagle.py`, which follow the
original EAGLE `cnets.py`):

    config.json         the target's config with "architectures": ["LlamaForCausalLMEagle"] (Llama) or
                        ["Qwen2ForCausalLMEagle"] (Qwen2), "num_hidden_layers": 1
    model.safetensors   fc.weight [H, 2H], fc.bias [H]   (fc input = concat(embedding, feature), in that order)
                        layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v .bias for Qwen2 / attention_bias)
                        layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight
                        (no layers.0.input_layernorm: the engines replace it with the identity)
                        embed_tokens.weight (optional, as original EAGLE checkpoints carry it; the engine
                        shares the target's), lm_head.weight (optional; SGLang skips it and shares the target's)
    hot_token_map.pt    only with a reduced draft vocabulary: the int64 target ids of the draft vocabulary,
                        the file SGLang takes as `--speculative-token-map` (FR-Spec)

`format="vllm"` (vLLM `vllm/model_executor/models/llama_eagle.py`, `EagleLlamaForCausalLM`, the only EAGLE-1
draft model it registers for these families): "architectures": ["EagleLlamaForCausalLM"] (vLLM's EAGLEConfig
keeps a name that starts with "Eagle"), model_type "llama"; the same tensor names WITHOUT fc.bias (vLLM's fc
has none and its loader fails on a name it does not register), without embed_tokens / lm_head (vLLM then
shares the target's; a draft that carries them keeps its own). A Qwen2 drafter is written as a Llama layer
with `qkv_bias: true` (vLLM's Llama layer reads that key: bias on q/k/v, none on o_proj, which is the Qwen2
layer exactly). vLLM's EAGLE-1 model has no token map, so a reduced vocabulary cannot be served there
(`full_vocab=True` exports the drafter over the whole vocabulary instead), and a non-zero fc bias would be
dropped (train with `Drafter(fc_bias=False)` for vLLM, or pass `drop_fc_bias=True` knowingly).

Names carry no "model." prefix: the engines' `load_weights` add it. The engines feed the target's
hidden state after its final norm and apply no norm before the LM head, which is the drafter's own
convention (see tlt_rt.models.drafter), so an exported drafter drafts the same tokens there.

`load_eagle` reads either layout back, and also a drafter training checkpoint (`drafter.safetensors` +
`info.json`, as `DrafterTrainer.save_checkpoint` writes), a run checkpoint (`.../checkpoints/step_N`, its
`drafter/`) or a run folder (its latest complete checkpoint): what `drafter.path` accepts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.drafter import Drafter
from tlt_rt.models.llama import CausalLM

EAGLE_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}
VLLM_ARCHITECTURE = "EagleLlamaForCausalLM"
FORMATS = ("sglang", "vllm")
TOKEN_MAP = "hot_token_map.pt"
_SHARED = ("embed_tokens.weight", "lm_head.weight")
CHECKPOINT_WEIGHTS = "drafter.safetensors"  # DrafterTrainer.save_checkpoint's files
CHECKPOINT_INFO = "info.json"
FEATURE_LAYERS_KEY = "tlt_feature_layers"  # config.json / info.json: a fused drafter's target layers


class ExportError(ValueError):
    """The drafter cannot be written in a form the chosen engine loads as the same model."""


def _vllm_config(arch: ArchConfig) -> dict:
    if arch.model_type not in ("llama", "qwen2"):
        raise ExportError(
            f"vLLM registers EAGLE-1 draft models for Llama-layer drafters only (EagleLlamaForCausalLM); "
            f"a {arch.model_type!r} drafter cannot be written for it: use --format sglang"
        )
    if arch.o_bias and not arch.qkv_bias:
        raise ExportError("vLLM's Llama layer cannot carry a bias on o_proj without one on q/k/v")
    cfg = arch.to_hf()
    cfg.update(model_type="llama", attention_bias=arch.o_bias)
    if arch.qkv_bias != arch.o_bias:
        cfg["qkv_bias"] = (
            arch.qkv_bias
        )  # vLLM's LlamaDecoderLayer: bias on q/k/v from qkv_bias, o_proj's from attention_bias
    return cfg


def export_eagle(
    drafter: Drafter,
    folder: str | Path,
    include_embed: bool | None = None,
    include_lm_head: bool = False,
    dtype: torch.dtype | None = None,
    format: str = "sglang",
    full_vocab: bool = False,
    drop_fc_bias: bool = False,
) -> Path:
    """Write `drafter` into `folder` as an EAGLE draft model (config.json + model.safetensors) that the engine
    `format` ("sglang" or "vllm", module docstring) loads; `include_embed` defaults to True for SGLang only.
    Raises ExportError where that engine would not load it as the same drafter."""
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r}; choose one of {FORMATS}")
    if drafter.feature_layers and format != "sglang":
        raise ExportError(
            f"this drafter fuses target layers {list(drafter.feature_layers)} (EAGLE-3 features), which vLLM's "
            "EAGLE-1 draft model cannot read: it serves in tlt_rt (the sglang-layout folder it writes)"
        )
    folder = Path(folder)
    arch = drafter.arch
    dtype = dtype or drafter.fc.weight.dtype
    state = {k: v for k, v in drafter.state_dict().items() if k != "d2t"}
    d2t = None if full_vocab else drafter.d2t
    if format == "sglang":
        include_embed = True if include_embed is None else include_embed
        cfg = arch.to_hf()
        cfg["architectures"] = [EAGLE_ARCHITECTURES[arch.model_type]]
        if "fc.bias" not in state:  # SGLang's fc has a bias: a bias-free drafter is one with a zero bias
            state["fc.bias"] = torch.zeros_like(drafter.fc.weight[:, 0])
    else:
        include_embed = bool(include_embed)
        cfg = _vllm_config(arch)
        cfg["architectures"] = [VLLM_ARCHITECTURE]
        if d2t is not None:
            raise ExportError(
                f"vLLM's EAGLE-1 draft model has no token map, and this drafter drafts over a reduced vocabulary "
                f"of {d2t.numel()} ids: export with --full-vocab (it then drafts over all "
                f"{arch.vocab_size} ids, as trained weights allow) or serve it with SGLang"
            )
        bias = state.pop("fc.bias", None)
        if bias is not None and bool(bias.abs().max() > 0) and not drop_fc_bias:
            raise ExportError(
                f"vLLM's EagleLlamaForCausalLM registers fc without a bias, and this drafter's fc.bias is non-zero "
                f"(max |b| = {float(bias.abs().max()):.3g}): train the drafter with fc_bias=False for vLLM, pass "
                f"--drop-fc-bias to export it anyway (it then drafts differently), or serve it with SGLang"
            )
    cfg.pop("torch_dtype", None)  # transformers 5 reads "dtype"; the deprecated name is not written
    cfg.update(num_hidden_layers=1, dtype=str(dtype).removeprefix("torch."))
    if drafter.feature_layers:  # tlt_rt's own key: the target layers `fuse` reads beside the last one
        cfg[FEATURE_LAYERS_KEY] = list(drafter.feature_layers)
    folder.mkdir(parents=True, exist_ok=True)
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
    if d2t is not None:
        torch.save(d2t.detach().cpu().to(torch.int64), token_map)
    elif token_map.exists():
        token_map.unlink()
    return folder


def find_drafter(path: str | Path) -> tuple[str, Path]:
    """Where `path`'s drafter lies: ("eagle", folder) for an EAGLE folder, ("checkpoint", folder) for a drafter
    training checkpoint; a run checkpoint leads to its drafter/, a run folder to its latest checkpoint's."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"drafter path {path} does not exist")
    if (path / "config.json").is_file() and not (path / "policy").is_dir():
        return "eagle", path
    if (path / CHECKPOINT_WEIGHTS).is_file():
        return "checkpoint", path
    if (path / "drafter" / CHECKPOINT_WEIGHTS).is_file():
        return "checkpoint", path / "drafter"
    root = path / "checkpoints"
    if root.is_dir():  # a run folder: the newest complete checkpoint (tlt_rt.train.rl.checkpoint's layout)
        steps = [p for p in root.glob("step_*") if (p / "COMPLETE").is_file() and (p / "drafter").is_dir()]
        if steps:
            return "checkpoint", max(steps, key=lambda p: int(p.name.removeprefix("step_"))) / "drafter"
        raise FileNotFoundError(f"{path}: a run folder with no complete checkpoint holding a drafter")
    raise FileNotFoundError(
        f"{path}: neither an EAGLE draft folder (config.json) nor a drafter checkpoint ({CHECKPOINT_WEIGHTS}), "
        "a run checkpoint (drafter/) or a run folder (checkpoints/)"
    )


def _load_checkpoint(folder: Path, target: CausalLM, dtype, device) -> Drafter:
    info_path = folder / CHECKPOINT_INFO
    if not info_path.is_file():
        raise FileNotFoundError(f"{folder}: no {CHECKPOINT_INFO} (the drafter's shape) beside {CHECKPOINT_WEIGHTS}")
    info = json.loads(info_path.read_text())
    arch = ArchConfig.from_hf(info["arch"], source=str(info_path))
    _check_fits(arch, target, info_path)
    weights = load_file(str(folder / CHECKPOINT_WEIGHTS))
    layers = info.get(FEATURE_LAYERS_KEY, [])
    drafter = Drafter(arch, target, fc_bias="fc.bias" in weights, feature_layers=layers).to(device, dtype)
    drafter.load_state_dict(weights, strict=True)  # adopts the checkpoint's d2t, if any
    return drafter.eval()


def _check_fits(arch: ArchConfig, target: CausalLM, source) -> None:
    if arch.hidden_size != target.arch.hidden_size or arch.vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"{source}: hidden_size/vocab_size {arch.hidden_size}/{arch.vocab_size} do not match the "
            f"target's {target.arch.hidden_size}/{target.arch.vocab_size}"
        )


def load_eagle(
    folder: str | Path, target: CausalLM, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> Drafter:
    """Build a Drafter bound to `target` from an EAGLE draft folder (either layout, ours or one alike), a
    drafter checkpoint, a run checkpoint or a run folder (`find_drafter`)."""
    device = torch.device(device) if device is not None else target.lm_head.weight.device
    dtype = dtype or target.lm_head.weight.dtype
    kind, folder = find_drafter(folder)
    if kind == "checkpoint":
        return _load_checkpoint(folder, target, dtype, device)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    known = {*EAGLE_ARCHITECTURES.values(), VLLM_ARCHITECTURE}
    if not set(archs) & known:
        raise ValueError(
            f"{cfg_path}: architectures {archs} name no EAGLE draft model (expected one of {sorted(known)})"
        )
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{cfg_path}: only one-layer drafters are supported, got {cfg['num_hidden_layers']}")
    hf = {**cfg, "num_hidden_layers": 1}
    if VLLM_ARCHITECTURE in archs and "qkv_bias" in cfg:  # a Qwen2 layer written as vLLM's Llama layer
        hf.update(attention_bias=cfg["qkv_bias"])
    arch = ArchConfig.from_hf(hf, source=str(cfg_path))
    if VLLM_ARCHITECTURE in archs:
        arch = dataclasses.replace(arch, o_bias=bool(cfg.get("attention_bias", False)))
    _check_fits(arch, target, cfg_path)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{folder}: no model.safetensors")
    with safe_open(str(weights), framework="pt") as st:
        names = {n.removeprefix("model.") for n in st.keys()}
    layers = cfg.get(FEATURE_LAYERS_KEY, [])
    drafter = Drafter(arch, target, fc_bias="fc.bias" in names, feature_layers=layers).to(device, dtype)
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
