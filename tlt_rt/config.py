"""The configuration, under one name: the loader (tlt_rt/config_loader.py), every section and the root
`TLTConfig` (train/config.py), so that `from tlt_rt.config import TLTConfig, load_config, RolloutConfig` works
for a user. Code inside tlt_rt imports the loader and each section from where they live, so that this module,
which imports all of them, is imported by none of them.

    python -m tlt_rt.config [CONFIG] [key=value ...] [--help-config]   # (python -m tlt_rt config ...)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tlt_rt.config_loader import apply_overrides, describe, from_dict, load_config, parse_cli, parse_value
from tlt_rt.models.config import Dtype, ModelConfig
from tlt_rt.options import (
    ConfigError,
    FieldDoc,
    check,
    check_min,
    config_fields,
    option,
    register,
    registered_configs,
    to_dict,
    type_name,
)
from tlt_rt.rollout.config import EngineConfig, PolicyConfig, RolloutConfig
from tlt_rt.train.cluster.config import ClusterConfig
from tlt_rt.train.config import FOREIGN_KEYS, TLTConfig
from tlt_rt.train.drafter.config import DrafterConfig
from tlt_rt.train.rl.config import DEFAULT_INSTRUCTION, LoggingConfig, RLConfig, TaskConfig
from tlt_rt.yaml12 import dump_yaml, parse_yaml

__all__ = [
    "DEFAULT_INSTRUCTION", "FOREIGN_KEYS", "ClusterConfig", "ConfigError", "DrafterConfig", "Dtype",
    "EngineConfig", "FieldDoc", "LoggingConfig", "ModelConfig", "PolicyConfig", "RLConfig", "RolloutConfig",
    "TLTConfig", "TaskConfig", "apply_overrides", "check", "check_min", "config_fields", "describe", "dump_yaml",
    "from_dict", "load_config", "main", "option", "parse_cli", "parse_value", "parse_yaml", "register",
    "registered_configs", "to_dict", "type_name",
]  # fmt: skip


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
