"""Hydra plumbing shared by the three stage CLIs.

Each CLI has one typed dataclass config (its schema) registered in the ConfigStore and one
primary YAML in conf/ that lists the schema first in its defaults; groups (target/, data/,
head/, ...) fill typed fields. `OmegaConf.to_object` then builds the dataclasses, so every
`__post_init__` validates its keys before any work starts (STYLE 3).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
T = TypeVar("T")


def register_schema(config_name: str, schema: type) -> None:
    ConfigStore.instance().store(name=f"{config_name}_schema", node=schema)


def to_config(cfg: Any) -> Any:
    """DictConfig -> typed dataclass tree (validation errors surface here, naming the key)."""
    return OmegaConf.to_object(cfg)


def compose(config_name: str, schema: type, overrides: Sequence[str] = ()) -> Any:
    """Compose a CLI's config without running it (tests, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema(config_name, schema)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_config(hydra_compose(config_name=config_name, overrides=list(overrides)))


def run_cli(config_name: str, schema: type, fn: Callable[[Any], Any]) -> None:
    """Entry point body for `python -m <stage>`: compose from argv overrides, validate, run."""
    import hydra

    register_schema(config_name, schema)

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _main(cfg) -> None:
        try:
            config = to_config(cfg)
        except (ValueError, TypeError) as exc:  # a bad key: say which, no traceback wall
            print(f"config error: {exc}", file=sys.stderr)
            sys.exit(2)
        fn(config)

    _main()
