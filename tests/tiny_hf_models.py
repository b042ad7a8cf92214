"""Tiny random Hugging Face checkpoints of each supported family (imported by tests as
`tiny_hf_models`; a plain module, since several conftest.py files would shadow each other)."""
from __future__ import annotations

import torch

# family -> HF config kwargs; every family exercises a different flag of ModelArch.
FAMILIES = {
    "llama3": dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}, tie_word_embeddings=False),
    "smollm2": dict(model_type="llama", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=24),
    # YaRN (cos/sin scaled by its attention factor 1.139); lengths past 64 interpolate.
    "qwen2_yarn": dict(model_type="qwen2", tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}),
}


def make_tiny_hf(family: str, path, seed: int = 0, **overrides):
    """Save a tiny random HF model of `family` to `path`; every weight perturbed so biases and
    norms are non-trivial. `overrides`: HF config fields over the defaults (e.g. head counts
    for tensor-parallel splits). Returns the HF model (fp32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=320, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    kw.update(FAMILIES[family], **overrides)
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model


# DeepSeek variant -> (HF class name, config kwargs). Each covers a different routing / MLA
# path; together: q low-rank on and off, YaRN (with mscale != mscale_all_dim, so the cos/sin
# attention factor is not 1), shared experts, first dense layers, group-limited routing.
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}
DEEPSEEK_FAMILIES = {
    # V2-Lite-like: no q low rank, softmax greedy, 2 shared experts, first layer dense, YaRN.
    "v2_lite": ("DeepseekV2", dict(q_lora_rank=None, topk_method="greedy", first_k_dense_replace=1,
                n_shared_experts=2, num_experts_per_tok=2,
                rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=0.8))),
    # V2-like: q low rank, group-limited greedy routing, scaled weights, plain rope.
    "v2_group": ("DeepseekV2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                 topk_group=2, routed_scaling_factor=2.0, first_k_dense_replace=1,
                 n_shared_experts=1, num_experts_per_tok=3)),
    # V3-like: q low rank, sigmoid + bias, noaux_tc groups, normalized top-k, YaRN, interleaved.
    "v3": ("DeepseekV3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
           routed_scaling_factor=2.5, first_k_dense_replace=1, n_shared_experts=1,
           num_experts_per_tok=2, rope_interleave=True,
           rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707))),
    # V3 with rotate-half rope (rope_interleave false), no q low rank, no dense layer.
    "v3_half": ("DeepseekV3", dict(q_lora_rank=None, n_group=2, topk_group=1,
                norm_topk_prob=False, routed_scaling_factor=1.5, first_k_dense_replace=0,
                n_shared_experts=1, num_experts_per_tok=2, rope_interleave=False)),
}


def make_tiny_deepseek(family: str, path=None, seed: int = 0):
    """A tiny random DeepSeek{V2,V3}ForCausalLM of `family` (fp32, eval), every weight and the
    router's e_score_correction_bias perturbed; saved to `path` when given."""
    import transformers

    prefix, kw = DEEPSEEK_FAMILIES[family]
    cfg = getattr(transformers, f"{prefix}Config")(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, max_position_embeddings=128,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.3 * torch.randn_like(p))  # spread router scores: no near-ties
            else:
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.eval()
    if path is not None:
        model.save_pretrained(path)
    return model


def add_native_mtp_layer(path, hf_model, seed: int = 1, moe: bool = False):
    """Make `path` (a saved tiny DeepSeek-V3 model) a DeepSeek-V3-style checkpoint with its MTP
    module at layer L = num_hidden_layers: config.json gets num_nextn_predict_layers = 1 and
    model.safetensors gains model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm,
    shared_head.head, embed_tokens, <a decoder layer>} (random; the two copies are the
    target's embedding and lm_head, as DeepSeek ships them). The layer is dense, or with moe
    an MoE layer like V3/R1's real layer 61 (transformers builds layer L as one), its routed
    experts written under the hub's per-expert names. Returns the MTP module's parts as
    transformers modules {enorm, hnorm, eh_proj, layer, shared_norm} for a reference."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer,
                                                                      DeepseekV3RMSNorm)

    path, cfg = Path(path), hf_model.config
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    assert moe or cfg.first_k_dense_replace >= 1  # layer_idx 0 builds the dense-MLP layer
    torch.manual_seed(seed)
    parts = {"enorm": DeepseekV3RMSNorm(h, cfg.rms_norm_eps),
             "hnorm": DeepseekV3RMSNorm(h, cfg.rms_norm_eps),
             "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
             "layer": DeepseekV3DecoderLayer(cfg, layer_idx=L if moe else 0),
             "shared_norm": DeepseekV3RMSNorm(h, cfg.rms_norm_eps)}
    with torch.no_grad():
        for m in parts.values():
            for name, p in m.named_parameters():
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else
                        0.3 * torch.randn_like(p) if name.endswith("mlp.gate.weight") else
                        0.05 * torch.randn_like(p))
            for name, b in m.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.05 * torch.randn_like(b))
    for m in parts.values():
        m.eval()
    pre = f"model.layers.{L}."
    mtp = {pre + "enorm.weight": parts["enorm"].weight, pre + "hnorm.weight": parts["hnorm"].weight,
           pre + "eh_proj.weight": parts["eh_proj"].weight,
           pre + "shared_head.norm.weight": parts["shared_norm"].weight,
           pre + "shared_head.head.weight": hf_model.lm_head.weight,
           pre + "embed_tokens.weight": hf_model.model.embed_tokens.weight,
           **{pre + k: v for k, v in hub_expert_names(parts["layer"].state_dict()).items()}}
    weights = load_file(str(path / "model.safetensors"))
    weights.update({k: v.detach().clone().contiguous() for k, v in mtp.items()})
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return parts


def hub_expert_names(state: dict) -> dict:
    """A transformers DeepSeek layer's state (fused mlp.experts.gate_up_proj [E, 2I, H] and
    down_proj [E, H, I]) -> the hub's per-expert names mlp.experts.{e}.{gate,up,down}_proj."""
    out = {k: v for k, v in state.items() if not k.startswith("mlp.experts.")}
    if "mlp.experts.gate_up_proj" in state:
        gu, down = state["mlp.experts.gate_up_proj"], state["mlp.experts.down_proj"]
        i = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            out[f"mlp.experts.{e}.gate_proj.weight"] = gu[e, :i]
            out[f"mlp.experts.{e}.up_proj.weight"] = gu[e, i:]
            out[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return out


def fused_expert_names(state: dict) -> dict:
    """Inverse of hub_expert_names (what transformers' layer loads with strict=True)."""
    out = {k: v for k, v in state.items() if not k.startswith("mlp.experts.")}
    n = len({k.split(".")[2] for k in state if k.startswith("mlp.experts.")})
    if n:
        out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            [state[f"mlp.experts.{e}.gate_proj.weight"], state[f"mlp.experts.{e}.up_proj.weight"]])
            for e in range(n)])
        out["mlp.experts.down_proj"] = torch.stack(
            [state[f"mlp.experts.{e}.down_proj.weight"] for e in range(n)])
    return out


def perturbed_copy(model, path, scale: float = 0.1, seed: int = 1):
    """Save HF `model` again to `path` with every weight moved by Gaussian noise of `scale` x
    that tensor's mean magnitude: another model that mostly agrees with `model` (a draft LLM
    whose drafts are accepted, and sometimes rejected). Returns the copy."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    other.save_pretrained(path)
    return other
