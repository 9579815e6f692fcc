"""A GGUF checkpoint's shape from its header alone, for the dry run's plan: no weights are read.

The header is parsed here rather than with `gguf.GGUFReader`, which decodes every metadata array into
numpy views: for a Qwen vocabulary (151,936 tokens and as many merges) that takes ~7 s, where skipping
the arrays takes a fraction of a second. The keys are llama.cpp's (`{arch}.embedding_length`, ...);
the values are mapped as transformers' GGUF loader maps them, so the result equals the ArchConfig of the
folder `convert_gguf` makes from the same file.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from tlt_rt.models.arch import ArchConfig

MAGIC = b"GGUF"
# metadata value types (gguf spec): fixed-width scalars; 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Header:
    """Walks the metadata and tensor infos of a mapped GGUF; arrays are kept as their length only."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def _take(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as e:
            raise ValueError(f"{self.path}: truncated GGUF header (at byte {self.pos})") from e
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header (string at byte {self.pos})")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._take("<I"), self._take("<Q")
            if etype == _STRING:
                for _ in range(count):
                    self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            elif etype in _SCALAR:
                self.pos += count * struct.calcsize(_SCALAR[etype])
            else:  # nested arrays: llama.cpp writes none, and we need no value from one
                for _ in range(count):
                    self._value(etype)
            return count
        if vtype not in _SCALAR:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {vtype} at byte {self.pos}")
        return self._take(_SCALAR[vtype])

    def read(self) -> tuple[dict[str, Any], set[str]]:
        """(metadata with arrays as lengths, tensor names)."""
        if bytes(self.buf[:4]) != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self._take("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        meta = {}
        for _ in range(n_kv):
            key = self._string()
            meta[key] = self._value(self._take("<I"))
        names = set()
        for _ in range(n_tensors):
            names.add(self._string())
            n_dims = self._take("<I")
            self.pos += 8 * n_dims + 4 + 8  # dims, ggml type, data offset
        return meta, names


def read_header(path: str | Path) -> tuple[dict[str, Any], set[str]]:
    """A GGUF file's metadata (arrays as their length) and its tensor names, without touching the data."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise ValueError(f"{path}: empty file, not a GGUF checkpoint")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Header(buf, path).read()


def gguf_arch(path: str | Path) -> ArchConfig:
    """The model shape a GGUF checkpoint describes, as the converted HF folder's config.json would give it."""
    path = Path(path).expanduser()
    meta, tensors = read_header(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: no general.architecture in the GGUF header")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    missing = [k for k in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
               if key(k) is None]  # fmt: skip
    if missing:
        raise ValueError(f"{path}: GGUF header lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    heads = key("attention.head_count")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    cfg = {
        "model_type": arch,  # ArchConfig.from_hf rejects the architectures we do not run, naming the file
        "vocab_size": key("vocab_size") or meta.get("tokenizer.ggml.tokens"),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        # transformers reads head_dim from rope.dimension_count for llama only; qwen2 derives it
        "head_dim": key("rope.dimension_count") if arch == "llama" else None,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }
    if cfg["vocab_size"] is None:
        raise ValueError(f"{path}: GGUF header gives no vocabulary size (no tokenizer.ggml.tokens)")
    return ArchConfig.from_hf(cfg, source=str(path))
