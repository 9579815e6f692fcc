"""The config loader: YAML + `key.sub=value` overrides, type-checked, into a tree of config dataclasses.

Components declare their own sections (tlt_rt/options.py says how; train/config.py lists where each lives);
this module only reads them, whatever the root dataclass. `load_config` reads a YAML mapping (YAML 1.2 scalars,
tlt_rt/yaml12.py), applies overrides, checks every value against its field's annotation and builds the tree;
each dataclass validates itself in `__post_init__`, and every failure is a `ConfigError` naming the full dotted
key (`rollout.max_batch: must be >= 1, got 0`). `tlt_rt.config` is the front of it: this loader, every section
and the root `TLTConfig` under one name.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import sys
import textwrap
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from tlt_rt.options import (
    ConfigError,
    check,
    config_fields,
    field_hints,
    init_fields,
    is_union,
    join_key,
    show,
    strip_optional,
    type_name,
)
from tlt_rt.yaml12 import NONE_WORDS, Loader, inline_yaml, parse_yaml

T = TypeVar("T")


# ----------------------------------------------------------------------------- building dataclasses
def _foreign(full_key: str, table: Mapping[str, tuple[str, ...]], ours: set[str]) -> str | None:
    """A hint for a key spelt as another trainer spells it, matching its dotted tails (longest first)."""
    parts = full_key.lower().split(".")
    for i in range(len(parts)):
        tail = ".".join(parts[i:])
        if tail in table:
            key, who, *note = table[tail]
            return f"did you mean '{key}'? ('{tail}' is {who} name for it{'; ' + note[0] if note else ''})"
        if i > 0 and tail in ours:  # our key under another trainer's prefix (actor_rollout_ref.rollout.top_k)
            return f"did you mean '{tail}'?"
    return None


def _unknown(full_key: str, candidates: Sequence[str], valid_here: Sequence[str], root: type) -> ConfigError:
    table = getattr(root, "FOREIGN_KEYS", None)  # a root config may name other trainers' keys (TLTConfig does)
    hint = _foreign(full_key, table, {doc.key for doc in config_fields(root)}) if table else None
    if hint is not None:
        return ConfigError(full_key, f"unknown key; {hint}")
    # compare case-folded so that MAX_BATCH still finds max_batch
    folded = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(full_key.lower(), list(folded), n=1, cutoff=0.6)
    hint = f"did you mean '{folded[close[0]]}'?" if close else "valid keys here: " + ", ".join(valid_here)
    return ConfigError(full_key, f"unknown key; {hint}")


def _coerce(value: Any, tp: Any, key: str, root: type) -> Any:
    """Check `value` against annotation `tp`; converts only where lossless (int -> float, str -> Path)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if is_union(tp):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in NONE_WORDS)):
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, root)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(key, f"expected {type_name(tp)}, got {show(value)}")
    if origin is Literal:
        if any(type(a) is type(value) and a == value for a in args):
            return value
        msg = f"must be one of {', '.join(repr(a) for a in args)}; got {show(value)}"
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1)
            msg += f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(key, msg)
    if origin is list or tp is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list ({type_name(tp)}), got {show(value)}")
        item = args[0] if args else Any
        return [_coerce(v, item, f"{key}[{i}]", root) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping ({type_name(tp)}), got {show(value)}")
        kt, vt = args or (Any, Any)
        return {_coerce(k, kt, key, root): _coerce(v, vt, join_key(key, str(k)), root) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        # an empty YAML section (`rollout:` with every key commented out) means all defaults
        return from_dict(tp, {} if value is None else value, key, root)
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
        raise ConfigError(key, f"expected {type_name(tp)}, got {show(value)}")
    return value


def from_dict(cls: type[T], mapping: Mapping[str, Any], prefix: str = "", root: type | None = None) -> T:
    """Build `cls` from a (nested) mapping; `prefix` is its dotted position, used in error messages, and
    `root` the config it sits in (default `cls`), whose FOREIGN_KEYS answer unknown keys."""
    root = cls if root is None else root
    if not isinstance(mapping, Mapping):
        raise ConfigError(prefix, f"expected a mapping of {cls.__name__} keys, got {show(mapping)}")
    fields = {f.name: f for f in init_fields(cls)}
    hints = field_hints(cls)
    kwargs = {}
    for key, value in mapping.items():
        if key not in fields:
            names = list(fields)
            raise _unknown(join_key(prefix, str(key)), [join_key(prefix, n) for n in names], names, root)
        kwargs[key] = _coerce(value, hints[key], join_key(prefix, key), root)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(join_key(prefix, name), "required key is missing")
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
        inner, _ = strip_optional(tp)
        if typing.get_origin(inner) is dict:
            tp = typing.get_args(inner)[1] if typing.get_args(inner) else Any
            continue
        if not dataclasses.is_dataclass(inner):
            where = ".".join(parts[:i])
            raise ConfigError(key, f"'{where}' holds a {type_name(tp)}, not a section of keys")
        names = [f.name for f in init_fields(inner)]
        if part not in names:
            everything = [doc.key for doc in config_fields(cls)]
            raise _unknown(key, everything, [join_key(".".join(parts[:i]), n) for n in names], cls)
        tp = field_hints(inner)[part]
    return tp


def parse_value(text: str, tp: Any, key: str = "") -> Any:
    """Parse command-line text for a field of type `tp` (YAML 1.2 scalars and flow lists)."""
    text = text.strip()
    inner, optional = strip_optional(tp)
    if optional and text.lower() in NONE_WORDS:
        return None
    literal_str = typing.get_origin(inner) is Literal and all(isinstance(a, str) for a in typing.get_args(inner))
    if (inner in (str, Path) or literal_str) and not text.startswith(("'", '"')):
        return text  # `name=2024` names a run "2024"; quote the value to have YAML read it
    try:
        return yaml.load(text, Loader=Loader)
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
                raise ConfigError(".".join(parts[: i + 1]), f"expected a mapping, got {show(node[part])}")
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


# ----------------------------------------------------------------------------- documentation and CLI
def describe(cls: type) -> str:
    """Every dotted key of `cls` with its type, default and help (the `--help-config` listing)."""
    lines = []
    for doc in config_fields(cls):
        indent = "    " * doc.key.count(".")
        if doc.section:
            lines += ["", f"{indent}[{doc.key}] {doc.help}"]
            continue
        default = "(required)" if doc.default is dataclasses.MISSING else f"= {inline_yaml(doc.default)}"
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
