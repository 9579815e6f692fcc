"""Declaring config fields: the part of the config system that components import.

Each component owns a small dataclass next to its code (`EngineConfig` in rollout/config.py, `DrafterConfig`
in train/drafter/config.py, ...) whose every field is declared with `option(default, help=...)` and whose
`__post_init__` checks its values with `check(...)` using keys relative to itself. The loader
(tlt_rt/config.py) prefixes them with the section's dotted path, so every failure names the full key
(`rollout.max_batch: must be >= 1, got 0`). This module imports nothing of tlt_rt: every component may use it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")


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
        return ConfigError(join_key(prefix, self.key), self.msg)


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


# ----------------------------------------------------------------------------- field types
def join_key(prefix: str, key: str) -> str:
    if not prefix or not key:
        return prefix or key
    return prefix + key if key.startswith("[") else f"{prefix}.{key}"


def show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def strip_optional(tp: Any) -> tuple[Any, bool]:
    """(X, True) for Optional[X] / X | None, else (tp, False)."""
    if is_union(tp) and type(None) in typing.get_args(tp):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007
    return tp, False


def type_name(tp: Any) -> str:
    """How a field's type reads in messages and `describe`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "{" + "|".join(str(a) for a in args) + "}"
    if is_union(tp):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return "path" if tp is Path else getattr(tp, "__name__", repr(tp))


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str
    type: str
    default: Any
    help: str
    section: bool


def config_fields(cls: type, prefix: str = "") -> Iterator[FieldDoc]:
    """Every dotted key of `cls`, sections before their fields, in declaration order."""
    hints = field_hints(cls)
    for f in init_fields(cls):
        key, tp = join_key(prefix, f.name), hints[f.name]
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        inner, _ = strip_optional(tp)
        section = dataclasses.is_dataclass(inner)
        yield FieldDoc(key, type_name(tp), default, f.metadata.get("help", ""), section)
        if section:
            yield from config_fields(inner, key)


def to_dict(obj: Any) -> Any:
    """Plain YAML-ready data (dicts, lists, scalars) from a config tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in init_fields(type(obj))}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
