"""Bad DeepSeek input fails with errors that name the key or tensor."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_hf_models import make_tiny_deepseek
from inference_eval.engine.model.arch import ModelArch, UnsupportedArchitectureError
from inference_eval.engine.target import TargetConfig, load_target


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_v2_group")
    make_tiny_deepseek("v2_group", d)
    return d


@pytest.fixture(scope="module")
def v2_config(v2_dir):
    import json

    return json.loads((v2_dir / "config.json").read_text())


@pytest.mark.parametrize("key,value,match", [
    ("topk_method", "sinkhorn", "topk_method='sinkhorn'"),
    ("scoring_func", "sparsemax", "scoring_func='sparsemax'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config 'fp8'"),
])
def test_unsupported_variant_is_named(v2_config, key, value, match):
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config(dict(v2_config, **{key: value}))


def test_unsupported_routing_is_an_architecture_error(v2_config):
    with pytest.raises(UnsupportedArchitectureError, match="noaux_tc"):
        # noaux_tc is sigmoid routing; with softmax the pair is refused, naming what fits.
        ModelArch.from_hf_config(dict(v2_config, topk_method="noaux_tc"))


@pytest.mark.parametrize("fields,match", [
    (dict(topk_method="group_limited_greedy", n_group=None, topk_group=None), "n_group"),
    (dict(n_group=3, topk_group=1), "n_group=3"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7"),
])
def test_inconsistent_sizes_are_named(v2_config, fields, match):
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config(dict(v2_config, **fields))


def _load_edited(tmp_path, v2_dir, edit):
    """Load a copy of the tiny V2 checkpoint whose state dict `edit` changed in place."""
    d = tmp_path / "edited"
    shutil.copytree(v2_dir, d)
    sd = load_file(str(d / "model.safetensors"))
    edit(sd)
    save_file(sd, str(d / "model.safetensors"))
    return load_target(TargetConfig(source="hf", path=str(d)), with_tokenizer=False)


def test_missing_expert_tensor_is_named(tmp_path, v2_dir):
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.gate_up_proj \(experts 5"):
        _load_edited(tmp_path, v2_dir,
                     lambda sd: sd.pop("model.layers.2.mlp.experts.5.up_proj.weight"))


def test_fp8_scale_tensor_is_named(tmp_path, v2_dir):
    with pytest.raises(ValueError, match="kv_b_proj.weight_scale_inv.*FP8"):
        _load_edited(tmp_path, v2_dir, lambda sd: sd.update(
            {"model.layers.1.self_attn.kv_b_proj.weight_scale_inv": torch.ones(1, 1)}))


def test_dense_tensor_on_a_moe_layer_is_named(tmp_path, v2_dir):
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.gate_proj\.weight"):
        _load_edited(tmp_path, v2_dir, lambda sd: sd.update(
            {"model.layers.2.mlp.gate_proj.weight": torch.zeros(96, 64)}))
