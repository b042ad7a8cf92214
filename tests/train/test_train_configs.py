"""Every shipped head and target config composes into a typed TrainConfig (hub targets are
only composed, never loaded)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from inference_eval.hydra_app import CONF_DIR, compose
from train.config import TrainConfig

HEADS = sorted(p.stem for p in (CONF_DIR / "head").glob("*.yaml"))
TARGETS = sorted(p.stem for p in (CONF_DIR / "target").glob("*.yaml"))


def test_config_lists_are_not_empty():
    assert {"mtp", "eagle1", "eagle3", "medusa"} <= set(HEADS)
    assert {"tiny", "smollm2"} <= set(TARGETS)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("head", HEADS)
def test_every_head_and_target_composes(head, target):
    cfg = compose("train", TrainConfig, [f"head={head}", f"target={target}"])
    assert isinstance(cfg, TrainConfig)
    for group, name, node in (("head", head, cfg.head), ("target", target, cfg.target)):
        for key, value in yaml.safe_load(Path(CONF_DIR / group / f"{name}.yaml").read_text()).items():
            assert getattr(node, key) == value, f"{group}={name}: {key}"
