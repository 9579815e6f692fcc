"""benchmarks/step_costs.py on a CPU: the shape table it shares with the dry run, what `--model` accepts, the
floor's weight bytes, the printed table and the profile's step summary. The timings themselves need a GPU."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tlt_rt.config import TLTConfig, load_config
from tlt_rt.models import CausalLM, save_target
from tlt_rt.models.arch import ArchConfig
from tlt_rt.models.default import fetched_gguf
from tlt_rt.models.registry import MODELS
from tlt_rt.models.shapes import KNOWN_SHAPES, RANK_SHAPES, SHAPES
from tlt_rt.train.__main__ import resolve_arch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from step_costs import (  # noqa: E402
    KNOBS,
    VARIANTS,
    build_model,
    digest,
    floor_seconds,
    main,
    model_source,
    print_compare,
    print_rows,
    step_summary,
    table_blocks,
    weight_bytes,
    wide_variant,
)

TINY = ArchConfig(model_type="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, qkv_bias=True,
                  tie_word_embeddings=True)  # fmt: skip


def test_old_names_stay_and_the_rank_shape_is_the_one_it_was():
    assert {"qwen2.5-7b", "qwen2.5-32b", "llama-70b-tp8-rank"} <= set(SHAPES)
    assert {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m", "llama3-70b"} <= set(KNOWN_SHAPES)
    assert set(SHAPES) == set(KNOWN_SHAPES) | set(RANK_SHAPES)
    assert RANK_SHAPES["llama-70b-tp8-rank"] == dict(
        model_type="llama", vocab_size=128256 // 8, hidden_size=8192, intermediate_size=28672 // 8,
        num_hidden_layers=80, num_attention_heads=64 // 8, num_key_value_heads=8 // 8, head_dim=128,
        rope_theta=5e5, max_position_embeddings=131072,
    )  # fmt: skip
    assert all(m.shape in KNOWN_SHAPES for m in MODELS.values())


@pytest.mark.parametrize("name", sorted(KNOWN_SHAPES))
def test_step_costs_builds_the_shape_the_dry_run_plans(name):
    cfg = load_config(TLTConfig, None, [f"model.path=/not/here/{name}", f"model.arch={name}"])
    planned, source = resolve_arch(cfg)
    assert source.startswith(f"known shape {name}")
    assert model_source(name) == "shape"
    assert build_model(name, device="meta").arch == planned  # meta: the shape without allocating its weights


def test_model_argument_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "cache"))
    assert model_source("smollm2") == "checkpoint"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for checkpoint in (gguf, folder, folder / "config.json"):
        assert model_source(str(checkpoint)) == "checkpoint"
    (tmp_path / "weights.bin").write_bytes(b"")
    for bad in ("qwen2.5-8b", str(tmp_path / "weights.bin"), str(tmp_path), str(tmp_path / "absent.gguf")):
        with pytest.raises(ValueError, match="not a shape .*qwen2.5-coder-1.5b.*a .gguf file nor a model folder"):
            model_source(bad)
    name = "qwen2.5-coder-1.5b-instruct"
    with pytest.raises(ValueError, match=f"model {name} is not fetched yet: run `python -m tlt_rt.models.fetch"):
        model_source(name)
    fetched_gguf(name).parent.mkdir(parents=True)
    fetched_gguf(name).write_bytes(b"GGUF")
    assert model_source(name) == "checkpoint"


def test_cli_help_and_an_unknown_model_need_no_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "qwen2.5-coder-1.5b" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--model", "qwen2.5-8b"])
    assert e.value.code == 2 and "--model qwen2.5-8b: not a shape" in capsys.readouterr().err


def test_floor_counts_the_tied_head_once():
    v, h = TINY.vocab_size, TINY.hidden_size
    tied = CausalLM(TINY)
    untied = CausalLM(replace(TINY, tie_word_embeddings=False))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    every = sum(p.numel() for p in tied.parameters())  # the shared [V, H] tensor once
    assert weight_bytes(tied) == 4 * every
    # untied, the head is read and the embedding only by rows: the same bytes as the tied model
    assert weight_bytes(untied) == weight_bytes(tied) == 4 * (sum(p.numel() for p in untied.parameters()) - v * h)
    tied.fuse_projections()  # fused q/k/v and gate/up are views of the same parameters
    assert weight_bytes(tied) == 4 * every
    kv = 2 * (10 + 3) * TINY.num_hidden_layers * 2 * TINY.num_key_value_heads * TINY.head_dim * 2
    assert floor_seconds(tied, 2, 10, 3, bandwidth=2.0) == (4 * every + kv) / 2.0


def test_random_and_loaded_tied_models_share_their_head():
    arch = ArchConfig(**KNOWN_SHAPES["smollm2-135m"])
    model = build_model("smollm2-135m", device="meta")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    v, h, i, n = arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    assert weight_bytes(model) == 2 * (v * h + n * per_layer + h)  # bf16; the embedding once, as the head


def test_a_saved_folder_loads_through_the_project_loader(tmp_path):
    folder = save_target(CausalLM(TINY), tmp_path / "tiny")
    assert model_source(str(folder)) == "checkpoint"
    model = build_model(str(folder), device="cpu")
    assert model.arch == TINY and model.lm_head.weight is model.model.embed_tokens.weight
    assert weight_bytes(model) == 2 * sum(p.numel() for p in model.parameters())  # bf16, the head once


def test_table_has_percent_of_floor(capsys):
    rows = [
        dict(model="qwen2.5-coder-1.5b", batch=8, ctx=1024, tokens=1, ms=2.0, floor_ms=1.5, floor_fraction=0.75),
        dict(model="smollm2", batch=1, ctx=1024, tokens=16, ms=1.0, floor_ms=0.25, floor_fraction=0.25),
    ]
    print_rows(rows)
    header, first, second = capsys.readouterr().out.splitlines()
    assert header.split()[-3:] == ["%", "of", "floor"] and len(header) == len(first) == len(second)
    assert first.split() == ["qwen2.5-coder-1.5b", "8", "1024", "1", "2.000", "1.500", "75.0"]
    assert second.split()[-1] == "25.0"


def test_compare_names_its_variants_and_refuses_a_glue_flag_beside_them(capsys):
    """--compare builds each variant's glue itself; every variant is a KernelGlue the engine could run."""
    from tlt_rt.codegen.model_kernels import KernelGlue
    from tlt_rt.models.glue import Glue

    with pytest.raises(SystemExit) as e:
        main(["--compare", "base", "fused-norm", "--skinny"])
    assert e.value.code == 2 and "--compare builds each variant's glue itself" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--compare", "base", "fastest"])
    assert e.value.code == 2 and "unknown variant 'fastest'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--compare", "pdl", "pdl:bn=8,x=2"])  # a sweep variant with a key it does not know
    assert e.value.code == 2 and "expected pdl:bn=" in capsys.readouterr().err
    # sweep variants: pdl with one launch setting set from the name, kept while that variant's graphs are captured
    assert wide_variant("pdl:bn=16,w=8") and VARIANTS["pdl:bn=16,w=8"] == VARIANTS["pdl"]
    knob = KNOBS["pdl:bn=16,w=8"][("tlt_rt.codegen.kernels.skinny_gemm", "ONE_ROW_WIDE")]
    assert knob["block_n"] == 16 and knob["num_warps"] == 8
    assert wide_variant("pdl:narrow:bn=2") and wide_variant("pdl:attn:sw=4") and not wide_variant("base")
    assert wide_variant("pdl-rows:dot:bn=16,bk=256") and VARIANTS["pdl-rows:dot:bn=16,bk=256"] == VARIANTS["pdl-rows"]
    dot = KNOBS["pdl-rows:dot:bn=16,bk=256"][("tlt_rt.codegen.kernels.skinny_gemm", "DOT_META")]
    assert dot["block_n"] == 16 and dot["block_k"] == 256 and dot["whole"] == 0
    assert not wide_variant("pdl-3d") and not wide_variant("pdl-first:bn=2")
    # the chain of more rows through kernels.rows_gemm, with its own launch setting: both knobs held
    assert (
        wide_variant("pdl-rows2:split:bn=128,w=8,p=528")
        and VARIANTS["pdl-rows2:split:bn=128,w=8,p=528"][0]["norm_rows"] == 1
    )
    split = KNOBS["pdl-rows2:split:bn=128,w=8,p=528"]
    assert split[("tlt_rt.codegen.kernels.skinny_gemm", "DOT_KERNEL")] == "split"
    rows_meta = split[("tlt_rt.codegen.kernels.rows_gemm", "ROWS_META")]
    assert rows_meta["block_n"] == 128 and rows_meta["num_warps"] == 8 and rows_meta["programs"] == 528
    assert wide_variant("pdl-rows2:split:t=4")
    assert KNOBS["pdl-rows2:split:t=4"][("tlt_rt.codegen.kernels.rows_gemm", "ROWS_META")]["min_tiles"] == 4
    assert wide_variant("pdl:narrow:bn=4,f=1")  # with one row's products in the slab's layout
    flat = KNOBS["pdl:narrow:bn=4,f=1"]
    assert flat[("tlt_rt.codegen.kernels.skinny_gemm", "ROW_FLAT")] is True
    assert flat[("tlt_rt.codegen.kernels.skinny_gemm", "ONE_ROW_NARROW")]["block_n"] == 4
    assert ("tlt_rt.codegen.kernels.skinny_gemm", "ROW_FLAT") not in KNOBS["pdl:bn=16,w=8"]
    with pytest.raises(ValueError, match="f=0|1"):
        wide_variant("pdl:f=2")
    from tlt_rt.codegen.backend import TritonAttention

    for name, (glue_kw, attn_kw) in VARIANTS.items():
        glue, attn = KernelGlue(pieces=Glue(), **glue_kw), TritonAttention(**attn_kw)
        chained = name.startswith("pdl")  # every one-row kernel Triton's, launched with PDL
        assert glue.fused_norm == (name.startswith("fused") or chained)
        assert glue.skinny == ("skinny" in name or chained) and (glue.skinny_min_weight == 0) == chained
        assert bool(glue.pdl) == bool(attn.pdl) == chained and glue.prefetch == name.endswith("+prefetch")
        assert glue.pdl == attn.pdl == (2 if name.startswith("pdl-end") else chained)
        assert attn.fuse_rope == (name in ("rope-attn", "fused", "fused+skinny") or chained)


def test_compare_table_gives_each_variant_against_the_first(capsys):
    same = dict(batch=1, ctx=1024, tokens=1, floor_ms=0.75)
    rows = [
        dict(label="base", ms=1.8, pct_floor=41.7, vs_first=1.0, logits_digest="ab12", max_diff_vs_first=0.0, **same),
        dict(label="fused-norm", ms=1.5, pct_floor=50.0, vs_first=1.2, logits_digest="cd34", max_diff_vs_first=0.03,
             **same),
    ]  # fmt: skip
    print_compare(rows, "base")
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-5:] == ["x", "base", "logits", "max", "diff"]
    assert lines[3].split() == ["fused-norm", "1", "1024", "1", "1.500", "0.750", "50.0", "1.200", "cd34", "3.00e-02"]


def test_digest_tells_equal_outputs_from_different_ones():
    a = torch.arange(6, dtype=torch.bfloat16)
    assert digest(a) == digest(a.clone()) != digest(a + 1) and len(digest(a)) == 10


def test_step_summary_counts_kernels_per_layer_and_the_gaps():
    layers = 4
    rows = [  # kernel_table rows of one step: (name, us, launches)
        ("gemm", 600.0, 3 * layers + 1),  # q/k/v, o and down per layer; the LM head once
        ("rms_norm", 100.0, 2 * layers + 1),
        ("decode_attention", 200.0, layers),
        ("embedding", 10.0, 1),
    ]
    text = step_summary(rows, layers, replay_s=1.0e-3)
    assert text.startswith("27 kernels a step: 6 per layer x 4 layers + 3 outside them;")
    assert text.endswith("kernels 0.910 ms of a 1.000 ms replay, 0.090 ms (9%) between kernels")


def test_table_width_is_the_context_or_the_engine_width_asked_for():
    """--table widens each sequence's block table to an engine's (the splits attention chooses follow it)."""
    assert table_blocks(1024, 1, 16) == 65 and table_blocks(1024, 1, 16, table=2624) == 164
    assert table_blocks(1024, 48, 16, table=512) == 67  # never narrower than the positions the step holds
