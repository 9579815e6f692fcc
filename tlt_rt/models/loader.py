"""Load a target model from a HF folder (config.json + safetensors, sharded or not) or a `.gguf` file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.default import resolve_model_path
from tlt_rt.models.llama import CausalLM, Rotary

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# tensors that checkpoints may carry but that we derive ourselves
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def _safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise FileNotFoundError(
        f"no safetensors weights in {folder} (expected model.safetensors or model.safetensors.index.json)"
    )


def check_safetensors(path: Path) -> None:
    """Raise a ValueError naming `path` when it is not a whole safetensors file (reads the header only)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ValueError(f"{path}: truncated or not a safetensors file ({size} bytes, no whole header)")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"{path}: not a safetensors file (unreadable header: {e})") from e
    if 8 + n + end > size:
        raise ValueError(
            f"{path}: truncated safetensors file: {size} bytes, its header needs {8 + n + end}; "
            "copy or download it again"
        )


def check_model_folder(path: str | Path | None) -> Path:
    """Check a model reference without loading weights: config.json parses and every safetensors file is
    whole. Returns the folder; raises FileNotFoundError / ValueError naming the file at fault."""
    folder = resolve_model_path(path)
    ArchConfig.from_file(folder / "config.json")
    for f in _safetensor_files(folder):
        check_safetensors(f)
    return folder


def load_state_into(model: torch.nn.Module, files: list[Path], strict: bool = True) -> None:
    """Copy tensors from safetensors files into `model`'s parameters, checking every name and shape."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    seen: set[str] = set()
    tied = getattr(getattr(model, "arch", None), "tie_word_embeddings", False)
    for f in files:
        check_safetensors(f)
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in params:
                    if tied and name == "lm_head.weight":
                        continue
                    raise ValueError(f"{f}: tensor {name!r} does not belong to a {type(model).__name__}")
                t = st.get_tensor(name)
                p = params[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"{f}: tensor {name!r} has shape {tuple(t.shape)}, the config implies {tuple(p.shape)}"
                    )
                with torch.no_grad():
                    p.copy_(t.to(p.dtype))
                seen.add(name)
    if strict:
        needed = {n for n, _ in model.named_parameters()}
        if tied:
            needed.discard("lm_head.weight")
        missing = sorted(needed - seen)
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"{files[0].parent}: missing tensor(s) {', '.join(missing[:5])}{more}")


def load_target(
    path: str | Path | None = None,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
) -> CausalLM:
    """Build our CausalLM from a HF folder, a `.gguf` file, or None / "smollm2" for the embedded default."""
    device = torch.device(device)
    folder = resolve_model_path(path)
    arch = ArchConfig.from_file(folder / "config.json")
    files = _safetensor_files(folder)
    torch_dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to_empty(device=device).to(torch_dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = Rotary(arch).to(device)  # its buffer is derived, not loaded
    load_state_into(model, files)
    model.source_path = str(folder)
    return model.eval()


def save_target(model: CausalLM, folder: str | Path, tokenizer=None, max_shard_size: int | str = "5GB") -> Path:
    """Write `model` as a HF folder that transformers can also read: config.json and model.safetensors, or
    shards of at most `max_shard_size` with model.safetensors.index.json (the hub library's layout)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.arch.to_hf()
    cfg["dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for old in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a previous save's shards would shadow or mix with these
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({k: state[k] for k in names}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
