"""Config loading: YAML + dotted overrides, strict types, errors that name the full key."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Literal

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tlt_rt.config import (
    ConfigError,
    RolloutConfig,
    TLTConfig,
    apply_overrides,
    check,
    config_fields,
    describe,
    dump_yaml,
    from_dict,
    load_config,
    main,
    option,
    parse_cli,
    parse_yaml,
    register,
    registered_configs,
    to_dict,
)

FULL_YAML = """
name: exp1
output_dir: /tmp/out
resume: true
model: {path: /models/qwen, dtype: bfloat16, device: cuda, max_context: 4096}
task: {kind: jsonl, path: data.jsonl, question_field: prompt, answer_field: solution}
rollout:
  speculative: on
  strategies: [8_4_48, 6_2_12]
  temperature: 0
  top_p: 0.95
  top_k: 50
  max_new_tokens: 1024
  num_blocks: 512
  max_batch: 32
  enforce_eager: true
drafter: {path: d.pt, train_online: false, lr: 3e-5, noise_std: 0.1}
rl: {group_size: 16, lr: 1e-6, clip_low: 0.1, clip_high: 0.3, loss_agg: sequence, kl_coef: 0.01}
cluster: {num_workers: 4, gpus_per_worker: 2, tensor_parallel: 2, ray_address: "ray://head:10001"}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def load_text(text: str, overrides: tuple[str, ...] = ()) -> TLTConfig:
    return from_dict(TLTConfig, _apply(text, overrides))


def _apply(text: str, overrides: tuple[str, ...]) -> dict:
    return apply_overrides(TLTConfig, parse_yaml(text), overrides)


# ----------------------------------------------------------------------------- loading and round trips
def test_defaults_load_and_equal_plain_construction():
    assert load_config(TLTConfig) == TLTConfig()
    assert load_text("") == TLTConfig()


def test_full_yaml_reads_yaml12_scalars(tmp_path):
    cfg = load_config(TLTConfig, write(tmp_path, FULL_YAML))
    # YAML 1.1 would give True, [8448, 6212] and the string "3e-5" here
    assert cfg.rollout.speculative == "on"
    assert cfg.rollout.strategies == ["8_4_48", "6_2_12"]
    assert cfg.drafter.lr == 3e-5 and cfg.rl.lr == 1e-6
    assert cfg.rollout.temperature == 0.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.model.max_context == 4096 and cfg.cluster.ray_address == "ray://head:10001"
    assert cfg.task.kind == "jsonl" and cfg.task.path == "data.jsonl"
    assert load_text("task: {digits: 010}").task.digits == 10  # not octal 8


def test_round_trip_yaml_dump_load(tmp_path):
    cfg = load_config(TLTConfig, write(tmp_path, FULL_YAML))
    again = load_config(TLTConfig, write(tmp_path, dump_yaml(cfg)))
    assert again == cfg
    assert to_dict(again) == to_dict(cfg)


def test_empty_section_means_defaults():
    assert load_text("rollout:\n  # max_batch: 8\n").rollout == RolloutConfig()


def test_overrides_nested_list_bool_optional_literal(tmp_path):
    cfg = load_config(
        TLTConfig,
        write(tmp_path, FULL_YAML),
        [
            "rollout.max_batch=8",
            "model.path=/x",
            "rl.lr=2e-6",
            "rollout.strategies=[8_4_16,6_2_12]",
            "rollout.enforce_eager=false",
            "cluster.ray_address=none",
            "drafter.path=null",
            "rollout.speculative=off",
            "rollout.top_k=-1",
            "rollout.max_batch=16",  # later wins
        ],
    )
    assert cfg.rollout.max_batch == 16 and cfg.model.path == "/x" and cfg.rl.lr == 2e-6
    assert cfg.rollout.strategies == ["8_4_16", "6_2_12"]
    assert cfg.rollout.enforce_eager is False and cfg.rollout.speculative == "off"
    assert cfg.cluster.ray_address is None and cfg.drafter.path is None
    # untouched YAML values of the same sections survive
    assert cfg.rollout.top_p == 0.95 and cfg.model.dtype == "bfloat16"


def test_string_overrides_keep_the_text():
    cfg = load_config(TLTConfig, overrides=["name=2024", "task.kind=jsonl", "task.path=true", "model.path=1e5"])
    assert cfg.name == "2024" and cfg.task.path == "true" and cfg.model.path == "1e5"
    assert load_config(TLTConfig, overrides=["name='  padded'"]).name == "  padded"


def test_section_override_merges():
    cfg = load_text("rollout: {max_batch: 8}", ("rollout={top_k: 5}",))
    assert cfg.rollout.max_batch == 8 and cfg.rollout.top_k == 5


def test_dumped_strings_that_look_like_numbers_stay_strings():
    cfg = load_config(TLTConfig, overrides=["name=1e5", "model.path=8_4_48", "output_dir=on"])
    text = dump_yaml(cfg)
    assert from_dict(TLTConfig, parse_yaml(text)) == cfg
    # and a YAML 1.1 reader sees the same strings
    assert yaml.safe_load(text)["model"]["path"] == "8_4_48"
    assert yaml.safe_load(text)["output_dir"] == "on"


# ----------------------------------------------------------------------------- errors
BAD = [
    # (yaml, overrides, substrings the message must contain)
    ("rollout: {max_bach: 3}", (), ["rollout.max_bach", "did you mean 'rollout.max_batch'"]),
    ("", ("rollout.max_bach=3",), ["rollout.max_bach", "did you mean 'rollout.max_batch'"]),
    ("", ("rolout.max_batch=3",), ["rolout.max_batch", "did you mean 'rollout.max_batch'"]),
    ("", ("MAX_BATCH=3",), ["did you mean 'rollout.max_batch'"]),
    ("rolout: {}", (), ["rolout", "did you mean 'rollout'"]),
    ("zzz: 1", (), ["zzz", "unknown key", "valid keys here: name"]),
    ("rollout: {max_batch: '32'}", (), ["rollout.max_batch", "expected int", "str '32'"]),
    ("rollout: {max_batch: 3.5}", (), ["rollout.max_batch", "expected int"]),
    ("rollout: {enforce_eager: 1}", (), ["rollout.enforce_eager", "expected bool"]),
    ("rollout: {enforce_eager: yes}", (), ["rollout.enforce_eager", "expected bool"]),
    ("rl: {lr: true}", (), ["rl.lr", "expected float"]),
    ("model: {path: null}", (), ["model.path", "expected str"]),
    ("rollout: {strategies: 8_4_48}", (), ["rollout.strategies", "expected a list"]),
    ("rollout: {strategies: [8_4_48, 3]}", (), ["rollout.strategies[1]", "expected str"]),
    ("rollout: {speculative: maybe}", (), ["rollout.speculative", "one of 'off', 'on', 'auto'"]),
    ("rollout: 5", (), ["rollout", "expected a mapping"]),
    ("rollout: 5", ("rollout.max_batch=3",), ["rollout", "expected a mapping"]),
    ("", ("rollout.max_batch=abc",), ["rollout.max_batch", "expected int"]),
    ("", ("rollout.enforce_eager=1",), ["rollout.enforce_eager", "expected bool"]),
    ("", ("rl.lr=fast",), ["rl.lr", "expected float"]),
    ("", ("rl.lr=1" + "0" * 400,), ["rl.lr", "expected float"]),
    ("", ("rl.lr=.nan",), ["rl.lr", "NaN"]),
    ("", ("rollout.speculative=of",), ["rollout.speculative", "did you mean 'off'"]),
    ("", ("rollout.strategies=[8_4_48",), ["rollout.strategies", "cannot parse"]),
    ("", ("rollout.max_batch.x=1",), ["rollout.max_batch.x", "not a section"]),
    ("", ("rollout.max_batch",), ["rollout.max_batch", "key.sub=value"]),
    # impossible values
    ("", ("rollout.max_new_tokens=-1",), ["rollout.max_new_tokens", ">= 1"]),
    ("", ("rl.clip_high=0.1",), ["rl.clip_high", "clip_low"]),
    ("", ("rl.clip_low=0",), ["rl.clip_low"]),
    ("", ("rollout.strategies=[8_4_48,8_x_4]",), ["rollout.strategies[1]", "8_x_4"]),
    ("", ("rollout.strategies=[8_4]",), ["rollout.strategies[0]"]),
    ("", ("rollout.strategies=[1_2_50]",), ["rollout.strategies[0]", "verify_tokens"]),
    ("", ("rollout.strategies=[8_4_48,8_4_48]",), ["rollout.strategies", "duplicates"]),
    ("", ("rollout.speculative=on", "rollout.strategies=[]"), ["rollout.strategies", "empty"]),
    ("", ("task.kind=jsonl",), ["task.path", "required"]),
    ("", ("task.kind=parquet", "task.path=none"), ["task.path", "required"]),
    ("", ("task.digits=0",), ["task.digits"]),
    ("", ("rollout.top_p=0",), ["rollout.top_p"]),
    ("", ("rollout.top_k=0",), ["rollout.top_k"]),
    ("", ("rollout.temperature=-0.5",), ["rollout.temperature"]),
    ("", ("rollout.block_size=12",), ["rollout.block_size", "power of two"]),
    ("", ("rl.group_size=1",), ["rl.group_size"]),
    ("", ("drafter.lr=0",), ["drafter.lr"]),
    ("", ("drafter.hidden_loss_weight=0", "drafter.token_loss_weight=0"), ["drafter.token_loss_weight"]),
    ("", ("cluster.tensor_parallel=0",), ["cluster.tensor_parallel"]),
    ("", ("rl.learner_shard=zero3",), ["rl.learner_shard"]),
    ("", ("cluster.gpus_per_worker=3", "cluster.tensor_parallel=2"), ["cluster.tensor_parallel"]),
    ("", ("cluster.tensor_parallel=2", "cluster.tp_allreduce=oneshot"), ["cluster.tp_allreduce", "GPU workers"]),
    ("", ("cluster.drafter_tp=half",), ["cluster.drafter_tp"]),
    ("", ("rollout.max_new_tokens=2048",), ["rollout.max_new_tokens", "model.max_context"]),
    ("", ("rollout.num_blocks=2",), ["rollout.num_blocks", "model.max_context"]),
    ("", ("name=a/b",), ["name"]),
    ("rl: {lr: 1e-6}\nrl: {lr: 2e-6}", (), ["duplicate key 'rl'"]),
    ("rl: [1", (), ["invalid YAML"]),
    ("- 1", (), ["top level must be a mapping"]),
]


@pytest.mark.parametrize(("text", "overrides", "expected"), BAD)
def test_bad_input_names_the_key(tmp_path, text, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(TLTConfig, write(tmp_path, text), overrides)
    for part in expected:
        assert part in str(info.value)


def test_config_error_is_value_error_and_pickles():
    with pytest.raises(ValueError):
        load_config(TLTConfig, overrides=["rollout.max_batch=0"])
    err = ConfigError("rollout.max_batch", "must be >= 1")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) == "rollout.max_batch: must be >= 1" and back.key == err.key


def test_direct_construction_validates_with_relative_key():
    with pytest.raises(ConfigError, match=r"^max_batch: must be >= 1"):
        RolloutConfig(max_batch=0)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(TLTConfig, "nope.yaml")


# ----------------------------------------------------------------------------- the generic mechanism
@dataclasses.dataclass
class _Inner:
    x: int = option(1, help="x")
    where: Path = option(Path("a"), help="a path")

    def __post_init__(self) -> None:
        if self.x < 0:
            raise ValueError("x must be >= 0")  # a plain error: the loader names the section
        check(self.x != 7, "x", "7 is unlucky")


@dataclasses.dataclass
class _Outer:
    needed: str = option(help="no default")
    inner: _Inner = option(factory=_Inner, help="a section")
    maybe: _Inner | None = option(None, help="an optional section")
    weights: dict[str, float] = option({"a": 1.0}, help="a mapping")
    mode: Literal["a", "b"] | None = option(None, help="optional literal")


def test_generic_mechanism():
    out = from_dict(_Outer, {"needed": "n", "inner": {"where": "b/c"}, "weights": {"z": 2}, "mode": "b"})
    assert out.inner.where == Path("b/c") and out.weights == {"z": 2.0} and out.mode == "b"
    assert out.maybe is None
    assert to_dict(out)["inner"]["where"] == "b/c"
    with pytest.raises(ConfigError, match=r"^needed: required key is missing"):
        from_dict(_Outer, {})
    with pytest.raises(ConfigError, match=r"^inner: x must be >= 0"):
        from_dict(_Outer, {"needed": "n", "inner": {"x": -1}})
    with pytest.raises(ConfigError, match=r"^top\.maybe\.x: 7 is unlucky"):
        from_dict(_Outer, {"needed": "n", "maybe": {"x": 7}}, prefix="top")
    with pytest.raises(ConfigError, match=r"^weights\.z: expected float"):
        from_dict(_Outer, {"needed": "n", "weights": {"z": "heavy"}})
    with pytest.raises(ConfigError, match=r"^mode: must be one of 'a', 'b'"):
        from_dict(_Outer, {"needed": "n", "mode": "c"})


def test_fields_without_help_are_refused():
    with pytest.raises(TypeError, match="help"):
        option(1, help=" ")

    @dataclasses.dataclass
    class Bare:
        x: int = 1

    with pytest.raises(TypeError, match="Bare.*x"):
        register(Bare)


# ----------------------------------------------------------------------------- documentation and CLI
def test_every_field_documented_and_described():
    text = describe(TLTConfig)
    docs = list(config_fields(TLTConfig))
    assert len(docs) > 50
    for doc in docs:
        assert doc.help.strip(), doc.key
        assert doc.key in text
    for cls in {*registered_configs(), TLTConfig}:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help", "").strip(), f"{cls.__name__}.{f.name}"
    assert "rollout.max_batch: int = 64" in text


def test_parse_cli_and_main(capsys, tmp_path):
    path = write(tmp_path, "rollout: {max_batch: 8}")
    assert parse_cli([str(path), "rl.lr=1e-6", "--help-config"]) == (str(path), ["rl.lr=1e-6"], ["--help-config"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_cli(["a.yaml", "b.yaml"])
    assert main([str(path), "rollout.top_k=5"]) == 0
    printed = capsys.readouterr().out
    assert load_text(printed).rollout.max_batch == 8 and load_text(printed).rollout.top_k == 5
    assert main(["rollout.max_bach=1"]) == 2
    assert "did you mean 'rollout.max_batch'" in capsys.readouterr().err
    assert main(["--help-config"]) == 0 and "drafter.lr" in capsys.readouterr().out


# ----------------------------------------------------------------------------- properties
@given(st.integers(min_value=-(2**62), max_value=2**62))
def test_int_override_round_trips_or_names_key(n):
    if n >= 1:
        cfg = load_config(TLTConfig, overrides=[f"rollout.max_batch={n}"])
        assert cfg.rollout.max_batch == n
        assert load_text(dump_yaml(cfg)) == cfg
    else:
        with pytest.raises(ConfigError, match=r"^rollout\.max_batch: must be >= 1"):
            load_config(TLTConfig, overrides=[f"rollout.max_batch={n}"])


@given(st.floats(min_value=1e-300, max_value=1e300))
def test_float_override_round_trips(lr):
    cfg = load_config(TLTConfig, overrides=[f"rl.lr={lr!r}"])
    assert cfg.rl.lr == lr
    assert load_text(dump_yaml(cfg)).rl.lr == lr


triples = st.tuples(st.integers(1, 9), st.integers(1, 4), st.integers(2, 12)).filter(
    lambda t: t[2] <= 1 + t[1] + (t[0] - 1) * t[1] ** 2
)


@given(st.lists(triples, min_size=1, max_size=5, unique=True))
def test_strategy_list_override_round_trips(ts):
    names = [f"{d}_{k}_{n}" for d, k, n in ts]
    cfg = load_config(TLTConfig, overrides=[f"rollout.strategies=[{','.join(names)}]"])
    assert cfg.rollout.strategies == names
    assert load_text(dump_yaml(cfg)) == cfg


@given(st.text(min_size=1).filter(lambda s: s.strip() and "/" not in s))
def test_any_name_round_trips_through_yaml(name):
    cfg = TLTConfig(name=name)
    assert load_text(dump_yaml(cfg)) == cfg


@pytest.mark.parametrize("rows", [0, 65])
def test_decode_chain_rows_outside_what_the_kernels_take_is_refused(rows):
    from tlt_rt.rollout.config import engine_config

    with pytest.raises(ConfigError, match="decode_chain_rows"):
        engine_config(None, decode_chain=True, decode_chain_rows=rows)
    assert engine_config(None, decode_chain=True, decode_chain_rows=64).decode_chain_rows == 64
