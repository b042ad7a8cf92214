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


def test_8xh100_script_overrides_compose():
    """scripts/train_8xh100.sh passes only keys the schema knows, with valid values."""
    import re
    import shlex

    text = (CONF_DIR.parent / "scripts" / "train_8xh100.sh").read_text()
    body = text[text.index("-m train \\"):].split("\n", 1)[1]
    body = body.replace('"$@"', "").replace("\\\n", " ")
    fill = {"SHARDS": "/data/shards", "OUT": "runs/h", "BATCH_TOKENS": "16384",
            "GRAD_ACCUM": "2", "STEPS": "4000", "TARGET_PATH": "meta-llama/Llama-3.1-70B-Instruct",
            "TARGET": "llama3_70b", "VAL_TP": "8", "VAL_EVERY": "250"}
    overrides = [re.sub(r"\$\{?(\w+)\}?", lambda m: fill[m.group(1)], tok)
                 for tok in shlex.split(body)]
    cfg = compose("train", TrainConfig, overrides)
    assert cfg.target.name == "llama3_70b" and cfg.head.type == "mtp"
    # TARGET=deepseek_v2_lite (docs/deepseek.md) composes too.
    fill.update(TARGET="deepseek_v2_lite", TARGET_PATH="deepseek-ai/DeepSeek-V2-Lite")
    ds = compose("train", TrainConfig, [re.sub(r"\$\{?(\w+)\}?", lambda m: fill[m.group(1)], tok)
                                        for tok in shlex.split(body)])
    assert ds.target.name == "deepseek_v2_lite" and ds.target.path == "deepseek-ai/DeepSeek-V2-Lite"
    assert cfg.trainer.strategy == "ddp" and cfg.trainer.mixed_precision == "bf16"
    # Validation on, the 8 ranks one tensor-parallel replica of the engine (tp_validation.py).
    assert cfg.validation.enabled and cfg.validation.tau_prompts > 0
    assert cfg.engine.tensor_parallel == 8 and cfg.trainer.eval_every == 250
