"""YAML text for configs, read with YAML 1.2 core scalars.

PyYAML's default 1.1 rules would turn the strategy `8_4_48` into the int 8448, `speculative: on` into
True, `010` into 8, and leave `1e-6` a string. Duplicate keys are refused.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from tlt_rt.options import ConfigError, show, to_dict

NONE_WORDS = frozenset({"none", "null", "~"})
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


class Loader(yaml.SafeLoader):
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


class Dumper(yaml.SafeDumper):
    pass


Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag in (_TAG + "null", _TAG + "merge")]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# the dumper quotes a string that either rule set would read as a non-string, so files we write
# read back the same here and in any YAML 1.1 tool
Dumper.yaml_implicit_resolvers = {ch: list(rs) for ch, rs in yaml.SafeDumper.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in _RESOLVERS_12:
    Loader.add_implicit_resolver(_tag, _rx, list(_first))
    Dumper.add_implicit_resolver(_tag, _rx, list(_first))
Loader.add_constructor(_TAG + "int", lambda loader, node: int(loader.construct_scalar(node)))


def parse_yaml(text: str, source: str = "<string>") -> dict[str, Any]:
    """Read a YAML mapping with YAML 1.2 scalars; an empty document is an empty mapping."""
    try:
        data = yaml.load(text, Loader=Loader)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{source}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{source}: the top level must be a mapping of sections, got {show(data)}")
    return data


def dump_yaml(obj: Any) -> str:
    """YAML text that `load_config` reads back into an equal config."""
    return yaml.dump(to_dict(obj), Dumper=Dumper, sort_keys=False, allow_unicode=True, default_flow_style=False)


def inline_yaml(value: Any) -> str:
    text = yaml.dump(to_dict(value), Dumper=Dumper, default_flow_style=True, width=10**9).strip()
    return text.removesuffix("...").strip()  # a bare scalar document ends with "..."
