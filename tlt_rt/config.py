"""Configs: component-owned dataclasses, read from YAML and overridden on the command line.

A config is a tree of dataclasses whose every field is declared with `option(default, help=...)`.
`load_config` reads a YAML mapping, applies `key.sub=value` overrides, checks every value against its
field's annotation and builds the tree. Each dataclass checks its own values in `__post_init__` with
`check(...)` using keys relative to itself; the loader prefixes them with the section's dotted path, so
every failure is a `ConfigError` naming the full key (`rollout.max_batch: must be >= 1, got 0`).

YAML is read with YAML 1.2 core scalars: PyYAML's default 1.1 rules would turn the strategy `8_4_48` into
the int 8448, `speculative: on` into True, `010` into 8, and leave `1e-6` a string.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from tlt_rt.ir.strategy import Strategy

T = TypeVar("T")
_NONE_WORDS = frozenset({"none", "null", "~"})


class ConfigError(ValueError):
    """A config value that cannot be used; `key` is its dotted name ("" when about the whole file)."""

    def __init__(self, key: str, msg: str) -> None:
        # both parts kept in args so the error pickles (Ray ships exceptions between processes)
        super().__init__(key, msg)
        self.key, self.msg = key, msg

    def __str__(self) -> str:
        return f"{self.key}: {self.msg}" if self.key else self.msg

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key placed under `prefix` (the section it was raised in)."""
        return ConfigError(_join(prefix, self.key), self.msg)


def check(cond: bool, key: str, msg: str) -> None:
    """Raise `ConfigError(key, msg)` unless `cond`; `key` is relative to the dataclass checking itself."""
    if not cond:
        raise ConfigError(key, msg)


def check_min(obj: Any, name: str, lo: float) -> None:
    """Check `obj.<name> >= lo`, the most common bound."""
    value = getattr(obj, name)
    check(value >= lo, name, f"must be >= {lo}, got {value!r}")


def option(default: Any = dataclasses.MISSING, *, help: str, factory: Callable[[], Any] | None = None) -> Any:
    """A documented dataclass field; list/dict/dataclass defaults are copied per instance."""
    if not help or not help.strip():
        raise TypeError("every config field needs a non-empty help string")
    meta = {"help": " ".join(help.split())}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if isinstance(default, list | dict | set) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


_REGISTRY: list[type] = []


def register(cls: type[T]) -> type[T]:
    """Record a config dataclass (for `registered_configs`), refusing fields without help."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass (apply @register above @dataclass)")
    bare = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
    if bare:
        raise TypeError(f"{cls.__name__}: fields without help (declare them with option()): {bare}")
    _REGISTRY.append(cls)
    return cls


def registered_configs() -> tuple[type, ...]:
    return tuple(_REGISTRY)


# ----------------------------------------------------------------------------- YAML 1.2 core scalars
_TAG = "tag:yaml.org,2002:"
_INT_RE = re.compile(r"^[-+]?[0-9]+$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_RESOLVERS_12 = [
    (_TAG + "bool", _BOOL_RE, "tTfF"),
    (_TAG + "int", _INT_RE, "-+0123456789"),
    (_TAG + "float", _FLOAT_RE, "-+0123456789."),
]


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    pass


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag in (_TAG + "null", _TAG + "merge")]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# the dumper quotes a string that either rule set would read as a non-string, so files we write
# read back the same here and in any YAML 1.1 tool
_Dumper.yaml_implicit_resolvers = {ch: list(rs) for ch, rs in yaml.SafeDumper.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in _RESOLVERS_12:
    _Loader.add_implicit_resolver(_tag, _rx, list(_first))
    _Dumper.add_implicit_resolver(_tag, _rx, list(_first))
_Loader.add_constructor(_TAG + "int", lambda loader, node: int(loader.construct_scalar(node)))


def parse_yaml(text: str, source: str = "<string>") -> dict[str, Any]:
    """Read a YAML mapping with YAML 1.2 scalars; an empty document is an empty mapping."""
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{source}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{source}: the top level must be a mapping of sections, got {_show(data)}")
    return data


# ----------------------------------------------------------------------------- building dataclasses
def _join(prefix: str, key: str) -> str:
    if not prefix or not key:
        return prefix or key
    return prefix + key if key.startswith("[") else f"{prefix}.{key}"


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """(X, True) for Optional[X] / X | None, else (tp, False)."""
    if _is_union(tp) and type(None) in typing.get_args(tp):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007
    return tp, False


def type_name(tp: Any) -> str:
    """How a field's type reads in messages and `describe`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "{" + "|".join(str(a) for a in args) + "}"
    if _is_union(tp):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return "path" if tp is Path else getattr(tp, "__name__", repr(tp))


# Other trainers' names for our knobs (verl, TRL, vLLM), matched on the unknown key's dotted tails, so an
# unknown `actor_rollout_ref.rollout.n` or `num_generations` is answered with ours.
FOREIGN_KEYS: dict[str, tuple[str, ...]] = {
    "rollout.n": ("rl.group_size", "verl's"),
    "num_generations": ("rl.group_size", "TRL's"),
    "clip_ratio_high": ("rl.clip_high", "verl's"),
    "epsilon_high": ("rl.clip_high", "TRL's"),
    "clip_ratio_low": ("rl.clip_low", "verl's"),
    "clip_ratio": ("rl.clip_low", "verl's"),
    "epsilon": ("rl.clip_low", "TRL's"),
    "kl_loss_coef": ("rl.kl_coef", "verl's"),
    "beta": ("rl.kl_coef", "TRL's"),
    "loss_agg_mode": ("rl.loss_agg", "verl's"),
    "loss_type": ("rl.loss_agg", "TRL's"),
    "max_tokens": ("rollout.max_new_tokens", "vLLM's"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL's"),
    "response_length": ("rollout.max_new_tokens", "verl's"),
    "max_response_length": ("rollout.max_new_tokens", "verl's"),
    "max_prompt_length": ("model.max_context", "verl's and TRL's", "ours bounds prompt + response"),
    "learning_rate": ("rl.lr", "TRL's"),
    "optim.lr": ("rl.lr", "verl's"),
    "train_batch_size": ("rl.prompts_per_step", "verl's"),
    "ppo_mini_batch_size": ("rl.mini_batches", "verl's", "ours counts them: train_batch_size / ppo_mini_batch_size"),
    "ppo_micro_batch_size_per_gpu": ("rl.micro_batch", "verl's"),
    "total_training_steps": ("rl.steps", "verl's"),
    "max_steps": ("rl.steps", "TRL's"),
    "grad_clip": ("rl.max_grad_norm", "verl's"),
    "norm_adv_by_std_in_grpo": ("rl.normalize_adv_std", "verl's"),
    "scale_rewards": ("rl.normalize_adv_std", "TRL's"),
    "tensor_model_parallel_size": ("cluster.tensor_parallel", "verl's"),
    "n_gpus_per_node": ("cluster.gpus_per_node", "verl's"),
    "nnodes": ("cluster.nodes", "verl's"),
    "model_name_or_path": ("model.path", "TRL's"),
    "train_files": ("task.path", "verl's"),
    "dataset_name": ("task.path", "TRL's"),
    "prompt_key": ("task.question_field", "verl's"),
    "reward_funcs": ("task.reward", "TRL's"),
    "report_to": ("logging.loggers", "TRL's"),
    "logger": ("logging.loggers", "verl's"),
    "torch_dtype": ("model.dtype", "transformers' deprecated"),
}


def _foreign(full_key: str, ours: set[str]) -> str | None:
    """A hint for a key spelt as another trainer spells it, matching its dotted tails (longest first)."""
    parts = full_key.lower().split(".")
    for i in range(len(parts)):
        tail = ".".join(parts[i:])
        if tail in FOREIGN_KEYS:
            key, who, *note = FOREIGN_KEYS[tail]
            return f"did you mean '{key}'? ('{tail}' is {who} name for it{'; ' + note[0] if note else ''})"
        if i > 0 and tail in ours:  # our key under another trainer's prefix (actor_rollout_ref.rollout.top_k)
            return f"did you mean '{tail}'?"
    return None


def _unknown(full_key: str, candidates: Sequence[str], valid_here: Sequence[str]) -> ConfigError:
    ours = {doc.key for doc in config_fields(TLTConfig)}
    hint = _foreign(full_key, ours) if all(c in ours for c in candidates) else None  # only inside TLTConfig
    if hint is not None:
        return ConfigError(full_key, f"unknown key; {hint}")
    # compare case-folded so that MAX_BATCH still finds max_batch
    folded = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(full_key.lower(), list(folded), n=1, cutoff=0.6)
    hint = f"did you mean '{folded[close[0]]}'?" if close else "valid keys here: " + ", ".join(valid_here)
    return ConfigError(full_key, f"unknown key; {hint}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; converts only where lossless (int -> float, str -> Path)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if _is_union(tp):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(key, f"expected {type_name(tp)}, got {_show(value)}")
    if origin is Literal:
        if any(type(a) is type(value) and a == value for a in args):
            return value
        msg = f"must be one of {', '.join(repr(a) for a in args)}; got {_show(value)}"
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1)
            msg += f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(key, msg)
    if origin is list or tp is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list ({type_name(tp)}), got {_show(value)}")
        item = args[0] if args else Any
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping ({type_name(tp)}), got {_show(value)}")
        kt, vt = args or (Any, Any)
        return {_coerce(k, kt, key): _coerce(v, vt, _join(key, str(k))) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        # an empty YAML section (`rollout:` with every key commented out) means all defaults
        return from_dict(tp, {} if value is None else value, key)
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and not (isinstance(value, int) and abs(value) > sys.float_info.max)
        value = float(value) if ok else value
        # NaN passes no comparison, so it would slip past bounds checks written as `not (x < lo)`
        check(not (ok and value != value), key, "must be a number, got NaN")
    elif tp is str:
        ok = isinstance(value, str)
    elif tp is Path:
        ok = isinstance(value, str | Path)
        value = Path(value) if ok else value
    else:
        raise TypeError(f"{key}: unsupported config field type {tp!r}")
    if not ok:
        raise ConfigError(key, f"expected {type_name(tp)}, got {_show(value)}")
    return value


def from_dict(cls: type[T], mapping: Mapping[str, Any], prefix: str = "") -> T:
    """Build `cls` from a (nested) mapping; `prefix` is its dotted position, used in error messages."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(prefix, f"expected a mapping of {cls.__name__} keys, got {_show(mapping)}")
    fields = {f.name: f for f in _init_fields(cls)}
    hints = _hints(cls)
    kwargs = {}
    for key, value in mapping.items():
        if key not in fields:
            names = list(fields)
            raise _unknown(_join(prefix, str(key)), [_join(prefix, n) for n in names], names)
        kwargs[key] = _coerce(value, hints[key], _join(prefix, key))
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(prefix, name), "required key is missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(prefix) from e
    except (ValueError, TypeError) as e:
        # a plain error from __post_init__ does not know its key: name the section at least
        raise ConfigError(prefix or cls.__name__, str(e)) from e


# ----------------------------------------------------------------------------- overrides and files
def _type_at(cls: type, key: str) -> Any:
    """The annotation of dotted `key` inside `cls`, or a ConfigError naming the closest valid key."""
    tp: Any = cls
    parts = key.split(".")
    for i, part in enumerate(parts):
        inner, _ = _strip_optional(tp)
        if typing.get_origin(inner) is dict:
            tp = typing.get_args(inner)[1] if typing.get_args(inner) else Any
            continue
        if not dataclasses.is_dataclass(inner):
            where = ".".join(parts[:i])
            raise ConfigError(key, f"'{where}' holds a {type_name(tp)}, not a section of keys")
        names = [f.name for f in _init_fields(inner)]
        if part not in names:
            everything = [doc.key for doc in config_fields(cls)]
            raise _unknown(key, everything, [_join(".".join(parts[:i]), n) for n in names])
        tp = _hints(inner)[part]
    return tp


def parse_value(text: str, tp: Any, key: str = "") -> Any:
    """Parse command-line text for a field of type `tp` (YAML 1.2 scalars and flow lists)."""
    text = text.strip()
    inner, optional = _strip_optional(tp)
    if optional and text.lower() in _NONE_WORDS:
        return None
    literal_str = typing.get_origin(inner) is Literal and all(isinstance(a, str) for a in typing.get_args(inner))
    if (inner in (str, Path) or literal_str) and not text.startswith(("'", '"')):
        return text  # `name=2024` names a run "2024"; quote the value to have YAML read it
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(key, f"cannot parse {text!r}: {getattr(e, 'problem', e)}") from e


def _merge(dst: dict, src: Mapping) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def apply_overrides(cls: type, raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the raw mapping `raw` with `key.sub=value` overrides applied in order (later wins)."""
    out = copy.deepcopy(dict(raw))
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(text, "an override must look like key.sub=value")
        value = parse_value(value_text, _type_at(cls, key), key)
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            elif not isinstance(node[part], dict):
                raise ConfigError(".".join(parts[: i + 1]), f"expected a mapping, got {_show(node[part])}")
            node = node[part]
        _merge(node, {parts[-1]: value})
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Read `path` (YAML; None = all defaults), apply `overrides`, type-check and validate into `cls`."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        raw = parse_yaml(path.read_text(), str(path))
    return from_dict(cls, apply_overrides(cls, raw, overrides))


def to_dict(obj: Any) -> Any:
    """Plain YAML-ready data (dicts, lists, scalars) from a config tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in _init_fields(type(obj))}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(obj: Any) -> str:
    """YAML text that `load_config` reads back into an equal config."""
    return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False, allow_unicode=True, default_flow_style=False)


def _inline_yaml(value: Any) -> str:
    text = yaml.dump(to_dict(value), Dumper=_Dumper, default_flow_style=True, width=10**9).strip()
    return text.removesuffix("...").strip()  # a bare scalar document ends with "..."


# ----------------------------------------------------------------------------- documentation and CLI
@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str
    type: str
    default: Any
    help: str
    section: bool


def config_fields(cls: type, prefix: str = "") -> Iterator[FieldDoc]:
    """Every dotted key of `cls`, sections before their fields, in declaration order."""
    hints = _hints(cls)
    for f in _init_fields(cls):
        key, tp = _join(prefix, f.name), hints[f.name]
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        inner, _ = _strip_optional(tp)
        section = dataclasses.is_dataclass(inner)
        yield FieldDoc(key, type_name(tp), default, f.metadata.get("help", ""), section)
        if section:
            yield from config_fields(inner, key)


def describe(cls: type) -> str:
    """Every dotted key of `cls` with its type, default and help (the `--help-config` listing)."""
    lines = []
    for doc in config_fields(cls):
        indent = "    " * doc.key.count(".")
        if doc.section:
            lines += ["", f"{indent}[{doc.key}] {doc.help}"]
            continue
        default = "(required)" if doc.default is dataclasses.MISSING else f"= {_inline_yaml(doc.default)}"
        lines.append(f"{indent}{doc.key}: {doc.type} {default}")
        lines += textwrap.wrap(doc.help, 100, initial_indent=indent + "    ", subsequent_indent=indent + "    ")
    return "\n".join(lines).strip("\n") + "\n"


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[str], list[str]]:
    """Split argv into (config path or None, `key=value` overrides, `--flags`)."""
    path, overrides, flags = None, [], []
    for arg in argv:
        if arg.startswith("-"):
            flags.append(arg)
        elif "=" in arg:
            overrides.append(arg)
        elif path is None:
            path = arg
        else:
            raise ConfigError("", f"unexpected argument {arg!r}: give one config file, then key.sub=value")
    return path, overrides, flags


# ============================================================================= the product's sections
# Each section belongs to one component (models/, train/data, rollout/, train/ drafter, train/ GRPO,
# train/ Ray); checks use keys relative to the section, the loader adds the section's name.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DEFAULT_INSTRUCTION = (
    'Solve the problem step by step. End your reply with "The answer is N." where N is the final number.'
)


@register
@dataclasses.dataclass
class ModelConfig:
    path: str = option(
        "smollm2",
        help="Target (policy) model: a Hugging Face folder (config.json + safetensors), a .gguf file, or "
        "'smollm2' for the embedded SmolLM2-135M that the CPU default trains.",
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
        "(smollm2-135m, qwen2.5-7b, qwen2.5-32b, llama3-70b); model.path/config.json wins when present.",
    )

    def __post_init__(self) -> None:
        check(bool(self.path.strip()), "path", "must not be empty")
        check_min(self, "max_context", 2)


@register
@dataclasses.dataclass
class TaskConfig:
    kind: Literal["arithmetic", "jsonl", "parquet"] = option(
        "arithmetic",
        help="Prompt source: 'arithmetic' generates verifiable arithmetic problems (no files needed); "
        "'jsonl' / 'parquet' read question/answer records from `path`.",
    )
    path: str | None = option(None, help="Dataset file; required when kind is jsonl or parquet.")
    digits: int = option(2, help="Arithmetic: digits per operand; more digits = harder problems.")
    num_ops: int = option(2, help="Arithmetic: operators per problem (2 means three operands).")
    word_problems: bool = option(
        True, help="Arithmetic: phrase problems in words rather than bare expressions (longer reasoning)."
    )
    seed: int = option(0, help="Seed for generating and shuffling prompts, so runs see the same data.")
    question_field: str = option(
        "question",
        help="jsonl/parquet: record field holding the prompt: text, or a chat message list (verl's and TRL's "
        "conversational `prompt`). Dotted names reach into nested records. With the default, a record without "
        "'question' falls back to 'prompt' (verl, TRL).",
    )
    answer_field: str = option(
        "answer",
        help="jsonl/parquet: record field holding the reference answer the reward checks against; dotted names "
        "reach into nested records. With the default, a record without 'answer' falls back to "
        "'reward_model.ground_truth' (verl), then 'solution' and 'ground_truth' (TRL / open-r1).",
    )
    instruction: str | None = option(
        DEFAULT_INSTRUCTION,
        help="Appended (on its own line) to every text question; null or '' = none. Chat-message prompts "
        "(verl/TRL datasets) carry their own instructions and are used as they are.",
    )
    reward: str = option(
        "numeric",
        help="How a response is scored against the reference answer: 'numeric' (the final number or \\boxed{} "
        "answer, compared by value); 'math_verify' (the math-verify library that TRL, verl and open-r1 use; "
        "pip install 'tlt_rt[math]'); or 'module:function', your own function(response: str, answer: str) -> "
        "float, imported by that path.",
    )

    def __post_init__(self) -> None:
        if self.kind in ("jsonl", "parquet"):
            check(bool(self.path), "path", f"is required when kind is {self.kind!r}")
        check_min(self, "digits", 1)
        check_min(self, "num_ops", 1)
        check(bool(self.question_field), "question_field", "must not be empty")
        check(bool(self.answer_field), "answer_field", "must not be empty")
        check(
            self.reward in ("numeric", "math_verify") or re.fullmatch(r"[\w.]+:\w+", self.reward) is not None,
            "reward",
            f"must be 'numeric', 'math_verify' or 'module:function', got {self.reward!r}",
        )


@register
@dataclasses.dataclass
class RolloutConfig:
    speculative: Literal["off", "on", "auto"] = option(
        "auto",
        help="Speculative decoding: 'off' = plain decoding only; 'on' = always, with the best strategy; "
        "'auto' = per step, whichever the cost model predicts is fastest (plain decoding while the batch "
        "is large, speculation in the long tail). Output is lossless in every mode.",
    )
    strategies: list[str] = option(
        ["8_4_48", "8_4_32", "8_4_16", "8_4_8", "6_2_12"],
        help="Speculative strategies to compile and choose between, each DEPTH_TOPK_VERIFYTOKENS: draft "
        "depth, top-k branching per draft step, tree tokens verified by the target per step.",
    )
    temperature: float = option(
        0.9, help="Sampling temperature of rollouts; 0 = greedy. GRPO needs > 0 for diverse groups."
    )
    top_p: float = option(1.0, help="Nucleus sampling: keep the smallest token set with this mass (0, 1].")
    top_k: int = option(-1, help="Sample among the k most likely tokens; -1 = no top-k filter.")
    max_new_tokens: int = option(256, help="Longest response per prompt, in tokens; the tail is this long.")
    block_size: int = option(16, help="Tokens per paged KV-cache block (a power of two).")
    num_blocks: int = option(
        0, help="KV-cache blocks per engine; 0 = size from free memory (GPU) or batch x context (CPU)."
    )
    max_batch: int = option(
        64, help="Most sequences one engine decodes at once (continuous batching); largest graph bucket."
    )
    enforce_eager: bool = option(
        False, help="Run every step eagerly, without CUDA graphs: slower, for debugging and profiling."
    )

    def __post_init__(self) -> None:
        for i, text in enumerate(self.strategies):
            try:
                Strategy.parse(text)
            except ValueError as e:
                raise ConfigError(f"strategies[{i}]", str(e)) from e
        check(len(set(self.strategies)) == len(self.strategies), "strategies", "has duplicates")
        check(
            self.speculative == "off" or bool(self.strategies),
            "strategies",
            f"is empty but speculative is {self.speculative!r}; set speculative=off to decode without speculation",
        )
        check_min(self, "temperature", 0.0)
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        check_min(self, "max_new_tokens", 1)
        bs = self.block_size
        check(bs >= 1 and bs & (bs - 1) == 0, "block_size", f"must be a power of two, got {bs}")
        check_min(self, "num_blocks", 0)
        check_min(self, "max_batch", 1)


@register
@dataclasses.dataclass
class DrafterConfig:
    path: str | None = option(
        None,
        help="Drafter to start from: an EAGLE folder (warm-up or export_drafter output), a run checkpoint "
        "(runs/X/checkpoints/step_N or its drafter/), or a run folder (its latest checkpoint); null = a fresh "
        "one-layer drafter built from the target.",
    )
    train_online: bool = option(
        True, help="Train the drafter on idle rollout workers so it keeps up with the changing policy."
    )
    lr: float = option(1e-4, help="Drafter learning rate.")
    batch_tokens: int = option(4096, help="Tokens per drafter training batch.")
    buffer_steps: int = option(
        4, help="RL steps of (token, target hidden state) data kept for drafter training; older is dropped."
    )
    hidden_loss_weight: float = option(
        1.0, help="Weight of the loss matching the target's next hidden state (EAGLE feature regression)."
    )
    token_loss_weight: float = option(
        0.1, help="Weight of the cross-entropy on the target's next token through the shared LM head."
    )
    noise_std: float = option(0.0, help="Std of Gaussian noise on input hidden states, for robustness.")
    unroll: int = option(
        1, help="Training-time test: passes that feed the drafter its own predictions (1 = teacher forcing only)."
    )
    unroll_context: Literal["chain", "shifted"] = option(
        "chain",
        help="Attention context of unrolled passes: 'chain' = exactly the engine's draft (true rows up to the root, "
        "then the row's own chain); 'shifted' = the older approximation (every row sees the same pass's rows).",
    )
    loss_temperature: float = option(
        1.0,
        help="Temperature of the target distribution the token loss matches; set it to rollout.temperature "
        "(0 = one-hot targets on the target's argmax, for greedy rollouts).",
    )
    sampled_token_weight: float = option(
        0.0, help="Weight of an extra cross-entropy on the token the rollout actually sampled next."
    )
    draft_vocab: int = option(
        0,
        help="Reduced draft vocabulary: the drafter's head covers this many of the rollouts' most frequent "
        "tokens, rebuilt from the training buffer as the policy moves; 0 = the full vocabulary.",
    )
    checkpoint_every: int = option(
        50, help="Drafter optimizer steps between checkpoints, so preempted training loses little."
    )
    tail_training: Literal["auto", "on", "off"] = option(
        "auto",
        help="Also train the drafter on a worker during its own rollout tail (a background thread once fewer "
        "than tail_fraction of its sequences still run); 'auto' = only with a single worker, which has no "
        "idle peers to train on.",
    )
    tail_fraction: float = option(
        0.25, help="A worker's rollout is in its tail when fewer than this fraction of its sequences still run."
    )
    max_spot_steps: int = option(
        0, help="Most drafter steps one worker trains per rollout (idle or tail); 0 = until the rollout ends."
    )

    def __post_init__(self) -> None:
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(0 < self.tail_fraction <= 1, "tail_fraction", f"must be in (0, 1], got {self.tail_fraction}")
        check_min(self, "max_spot_steps", 0)
        check_min(self, "batch_tokens", 1)
        check_min(self, "buffer_steps", 1)
        check_min(self, "hidden_loss_weight", 0.0)
        check_min(self, "token_loss_weight", 0.0)
        check(
            self.hidden_loss_weight + self.token_loss_weight > 0,
            "token_loss_weight",
            "hidden_loss_weight and token_loss_weight are both 0: the drafter would learn nothing",
        )
        check_min(self, "noise_std", 0.0)
        check_min(self, "checkpoint_every", 1)
        check_min(self, "unroll", 1)
        check_min(self, "loss_temperature", 0.0)
        check_min(self, "sampled_token_weight", 0.0)
        check_min(self, "draft_vocab", 0)


@register
@dataclasses.dataclass
class RLConfig:
    algorithm: Literal["grpo"] = option("grpo", help="Policy-optimisation algorithm.")
    group_size: int = option(
        8, help="Responses sampled per prompt; GRPO's advantage is each reward minus its group's mean."
    )
    prompts_per_step: int = option(8, help="Prompts per RL step (a step rolls out prompts x group_size).")
    lr: float = option(1e-6, help="Policy learning rate.")
    clip_low: float = option(0.2, help="PPO ratio clip below: ratio >= 1 - clip_low.")
    clip_high: float = option(
        0.28, help="PPO ratio clip above: ratio <= 1 + clip_high (DAPO clip-higher; >= clip_low)."
    )
    loss_agg: Literal["token", "sequence"] = option(
        "token",
        help="Loss averaging: 'token' = mean over all tokens of the step (long answers weigh more); "
        "'sequence' = mean per response, then over responses.",
    )
    kl_coef: float = option(0.0, help="Weight of the KL penalty to the reference policy; 0 = none.")
    drop_equal_reward_groups: bool = option(
        True, help="Skip groups whose rewards are all equal: their advantages are zero, no signal."
    )
    steps: int = option(100, help="RL steps to train.")
    seed: int = option(0, help="Seed of rollout sampling and the learner.")
    normalize_adv_std: bool = option(
        True, help="Divide each advantage by its group's reward std (GRPO); false = reward minus group mean only."
    )
    adv_eps: float = option(1e-6, help="Added to the group std before dividing, so near-equal groups stay finite.")
    max_grad_norm: float = option(1.0, help="Clip the policy gradient's global L2 norm to this; 0 = no clipping.")
    weight_decay: float = option(0.0, help="AdamW weight decay of the policy.")
    micro_batch: int = option(
        4, help="Responses per learner forward/backward; gradients accumulate over micro-batches (bounds memory)."
    )
    mini_batches: int = option(
        1, help="Optimizer steps per RL step: the step's responses are split into this many mini-batches."
    )
    recompute_logprobs: bool = option(
        False,
        help="Recompute the old log-probs with the learner's dense forward before the update instead of using "
        "the engine's (equal up to float rounding, since the engine samples exactly from the policy).",
    )
    learner_shard: Literal["none", "fsdp"] = option(
        "none",
        help="How the learner's weights and optimizer state are held: 'none' = a full replica per worker "
        "process, gradients all-reduced; 'fsdp' = sharded over every worker process with FSDP2 (fp32 master "
        "shards; bf16 compute on GPU), the engines given the gathered weights after each update.",
    )
    checkpoint_every: int = option(
        1, help="RL steps between checkpoints; 1 means killing the driver loses at most the current step."
    )
    keep_checkpoints: int = option(2, help="Most recent checkpoints kept in output_dir/name/checkpoints.")

    def __post_init__(self) -> None:
        check_min(self, "group_size", 2)
        check_min(self, "adv_eps", 0.0)
        check_min(self, "max_grad_norm", 0.0)
        check_min(self, "weight_decay", 0.0)
        check_min(self, "micro_batch", 1)
        check_min(self, "mini_batches", 1)
        check_min(self, "checkpoint_every", 1)
        check_min(self, "keep_checkpoints", 1)
        check_min(self, "prompts_per_step", 1)
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(0 < self.clip_low < 1, "clip_low", f"must be in (0, 1), got {self.clip_low}")
        check(
            self.clip_high >= self.clip_low,
            "clip_high",
            f"must be >= clip_low ({self.clip_low}), got {self.clip_high}",
        )
        check_min(self, "kl_coef", 0.0)
        check_min(self, "steps", 1)
        check(
            self.learner_shard in ("none", "fsdp"), "learner_shard", f"must be none or fsdp, got {self.learner_shard!r}"
        )


@register
@dataclasses.dataclass
class ClusterConfig:
    num_workers: int = option(2, help="Rollout workers (Ray actors); idle ones train the drafter.")
    gpus_per_worker: int = option(0, help="GPUs per rollout worker; 0 = CPU workers.")
    tensor_parallel: int = option(
        1,
        help="Ranks one engine shards the target over (one process each, in lockstep): GPUs, equal to "
        "gpus_per_worker; on CPU workers, processes of cpus_per_worker cores each.",
    )
    ray_address: str | None = option(None, help="Ray cluster to join; null = start a local one.")
    cpus_per_worker: int = option(1, help="CPU cores reserved per worker (its torch thread count on CPU workers).")
    gpus_per_node: int = option(8, help="GPUs per machine, for the placement plan (--dry-run).")
    nodes: int = option(
        0,
        help="Machines the --dry-run placement plan lays the workers over (each with gpus_per_node GPUs); "
        "0 = as many as the workers need (one on CPU). A live run plans over the Ray cluster's own nodes.",
    )
    cpus_per_node: int = option(0, help="CPU cores per machine for the --dry-run placement plan; 0 = not checked.")
    placement_timeout_s: float = option(
        120.0,
        help="Seconds to wait for the workers' Ray placement groups (one per tensor-parallel group) to be "
        "reserved before failing with the resources that were missing.",
    )
    gpu_memory_gb: float = option(80.0, help="Memory of one GPU in GiB, for the placement plan's fit check.")
    collective_timeout_s: float = option(
        600.0, help="Seconds a gradient/drafter all-reduce may wait for a peer before failing the step."
    )
    max_restarts: int = option(3, help="Worker restarts allowed per run; a dead worker's share is redone.")
    debug_fail: str | None = option(
        None,
        help="Testing aid: 'PHASE:RANK:STEP' (PHASE rollout or learn) makes that worker's process exit once, "
        "at that phase of that RL step, to exercise recovery.",
    )

    def __post_init__(self) -> None:
        check_min(self, "num_workers", 1)
        check_min(self, "cpus_per_worker", 1)
        check_min(self, "gpus_per_node", 1)
        check_min(self, "nodes", 0)
        check_min(self, "cpus_per_node", 0)
        check(self.placement_timeout_s > 0, "placement_timeout_s", f"must be > 0, got {self.placement_timeout_s}")
        check(self.gpu_memory_gb > 0, "gpu_memory_gb", f"must be > 0, got {self.gpu_memory_gb}")
        check(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0")
        check_min(self, "max_restarts", 0)
        if self.debug_fail is not None:
            parts = self.debug_fail.split(":")
            check(
                len(parts) == 3 and parts[0] in ("rollout", "learn") and all(p.isdigit() for p in parts[1:]),
                "debug_fail",
                f"must look like 'rollout:RANK:STEP' or 'learn:RANK:STEP', got {self.debug_fail!r}",
            )
        check_min(self, "gpus_per_worker", 0)
        check_min(self, "tensor_parallel", 1)
        gpus, tp = self.gpus_per_worker, self.tensor_parallel
        check(gpus == 0 or gpus % tp == 0, "tensor_parallel", f"must divide gpus_per_worker ({gpus}); got {tp}")


@register
@dataclasses.dataclass
class LoggingConfig:
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = option(
        ["jsonl"],
        help="Where step metrics go: 'jsonl' (RUN/metrics.jsonl, always written: resume and the report read it), "
        "'tensorboard' (RUN/tb; pip install tensorboard) and 'wandb' (pip install wandb; offline by default).",
    )
    wandb_project: str = option("tlt_rt", help="wandb project name.")
    wandb_mode: Literal["offline", "online"] = option(
        "offline", help="wandb mode: 'offline' writes under RUN/wandb (wandb sync uploads later); 'online' uploads."
    )
    progress_every_s: float = option(
        30.0,
        help="Seconds between plain progress lines (step k of N, time left) while a step runs; they also reach "
        "redirected logs, where progress bars are off. 0 = only the line after each step.",
    )

    def __post_init__(self) -> None:
        check("jsonl" in self.loggers, "loggers", "must include jsonl: resume and the report read metrics.jsonl")
        check(len(set(self.loggers)) == len(self.loggers), "loggers", "has duplicates")
        check_min(self, "progress_every_s", 0.0)


@register
@dataclasses.dataclass
class TLTConfig:
    name: str = option("tlt", help="Run name; outputs go to output_dir/name.")
    output_dir: str = option("runs", help="Folder for checkpoints, logs and cost tables.")
    resume: bool = option(False, help="Continue from the latest checkpoint in output_dir/name.")
    model: ModelConfig = option(factory=ModelConfig, help="The target (policy) model.")
    task: TaskConfig = option(factory=TaskConfig, help="Where prompts and reference answers come from.")
    rollout: RolloutConfig = option(factory=RolloutConfig, help="Generation: sampling, batching, speculation.")
    drafter: DrafterConfig = option(factory=DrafterConfig, help="The draft model and its online training.")
    rl: RLConfig = option(factory=RLConfig, help="The GRPO learner.")
    cluster: ClusterConfig = option(factory=ClusterConfig, help="Workers and devices.")
    logging: LoggingConfig = option(factory=LoggingConfig, help="Metrics loggers and progress lines.")
    tensorboard: bool = option(False, help="Same as listing tensorboard in logging.loggers (kept for old configs).")

    def __post_init__(self) -> None:
        check(
            bool(self.name.strip()) and "/" not in self.name,
            "name",
            f"must be a non-empty folder name without '/', got {self.name!r}",
        )
        ctx, r = self.model.max_context, self.rollout
        check(
            r.max_new_tokens < ctx,
            "rollout.max_new_tokens",
            f"must be < model.max_context ({ctx}) to leave room for a prompt, got {r.max_new_tokens}",
        )
        cap = r.num_blocks * r.block_size
        check(
            r.num_blocks == 0 or cap >= ctx,
            "rollout.num_blocks",
            f"{r.num_blocks} blocks x {r.block_size} tokens = {cap} cannot hold one sequence of "
            f"model.max_context ({ctx}) tokens",
        )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tlt_rt.config [CONFIG] [key=value ...] [--help-config]`: print the resolved config."""
    try:
        path, overrides, flags = parse_cli(sys.argv[1:] if argv is None else argv)
        if "--help-config" in flags:
            print(describe(TLTConfig), end="")
            return 0
        print(dump_yaml(load_config(TLTConfig, path, overrides)), end="")
        return 0
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
