"""The precompute-side configs: DataConfig (the `data` group: its errors name the key, every
shipped YAML matches the dataclass and composes) and DistillConfig (self-distillation)."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from inference_eval.hydra_app import compose
from precompute.data import DataConfig, register_data_configs
from precompute.distill import DistillConfig

CONF_DATA = Path(__file__).resolve().parents[2] / "conf" / "data"


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"source": "csv"}, "data.source"),
        ({"limit": 0}, "data.limit"),
        ({"skip": -1}, "data.skip"),
        ({"max_length": 1}, "data.max_length"),
        ({"source": "jsonl"}, "data.path"),
        ({"source": "hf"}, "data.hf_name"),
        ({"source": "hf", "hf_name": "x", "path": "y"}, "data.path"),
        ({"hf_name": "x"}, "data.hf_name"),
        ({"regen_temperature": -0.1}, "data.regen_temperature"),
        ({"regen_max_new_tokens": 0}, "data.regen_max_new_tokens"),
        ({"regenerate": "yes"}, "data.regenerate"),
    ],
)
def test_data_config_errors_name_the_key(kwargs, key):
    with pytest.raises((ValueError, TypeError), match=key.replace(".", r"\.")):
        DataConfig(**kwargs)


@pytest.mark.parametrize("name", ["sharegpt", "jsonl", "hf", "mix"])
def test_yaml_presets_match_the_dataclass_and_compose(name, tmp_path):
    from hydra import compose, initialize_config_dir

    yaml_node = OmegaConf.load(CONF_DATA / f"{name}.yaml")
    assert list(yaml_node) == list(DataConfig.__dataclass_fields__)
    assert yaml_node.source == name

    # Compose the preset through Hydra from a copy, so other groups in conf/ do not interfere.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / f"{name}.yaml").write_text((CONF_DATA / f"{name}.yaml").read_text())
    fill = {"jsonl": ["data.path=x.jsonl"], "hf": ["data.hf_name=org/chats"]}.get(name, [])
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(overrides=[f"+data={name}", "data.limit=5", *fill])
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), cfg.data)
    data = OmegaConf.to_object(merged)
    assert isinstance(data, DataConfig)
    assert (data.source, data.limit) == (name, 5)


def test_config_store_nodes_require_their_mandatory_key():
    from hydra.core.config_store import ConfigStore
    from omegaconf.errors import MissingMandatoryValue

    cs = ConfigStore.instance()
    register_data_configs(cs)
    nodes = {name: cs.repo["data"][f"{name}.yaml"].node for name in ("sharegpt", "jsonl", "hf")}
    assert OmegaConf.to_object(nodes["sharegpt"]) == DataConfig()
    for name, key in (("jsonl", "path"), ("hf", "hf_name")):
        assert nodes[name].source == name
        with pytest.raises(MissingMandatoryValue, match=key):
            OmegaConf.to_object(nodes[name])
    with pytest.raises(ValueError, match=r"data\.limit"):
        OmegaConf.to_object(OmegaConf.merge(nodes["jsonl"], {"path": "f.jsonl", "limit": 0}))


def test_shipped_config_composes_with_greedy_defaults():
    cfg = compose("distill", DistillConfig, [])
    assert (cfg.target.name, cfg.data.source, cfg.turns) == ("smollm2", "sharegpt", "first")
    assert cfg.sampling.temperature == 0.0 and cfg.engine.max_batch_size == 16
    assert DistillConfig().engine.max_batch_size == 16


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="turns"):
        DistillConfig(turns="second")
    with pytest.raises(ValueError, match="data.regenerate"):
        compose("distill", DistillConfig, ["data.regenerate=true"])
