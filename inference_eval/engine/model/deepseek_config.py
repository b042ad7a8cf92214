"""DeepSeek-V2/V3 Hugging Face config keys -> the ModelArch fields that describe them.

DeepSeek's own config.json (remote code) and transformers' DeepseekV2Config/V3Config share
these key names. Defaults follow each family: V2 routes with softmax + greedy and always
rotates interleaved pairs; V3 routes with sigmoid + noaux_tc (a bias-corrected,
group-limited top-k) and rotates interleaved pairs unless rope_interleave is false.
"""
from __future__ import annotations

from typing import Any

_ROUTING_DEFAULTS = {
    "DeepseekV2ForCausalLM": ("softmax", "greedy"),
    "DeepseekV3ForCausalLM": ("sigmoid", "noaux_tc"),
}


def deepseek_fields(arch: str, c: dict[str, Any]) -> dict[str, Any]:
    """ModelArch keyword arguments for the DeepSeek part of HF config dict `c`.

    Raises ValueError naming the key for what the engine does not run (a non-SiLU MLP, FP8
    block-quantized weights); unknown routing is refused by ModelArch itself."""
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act={act!r} is not supported (only silu)")
    quant = c.get("quantization_config") or {}
    if quant:
        raise ValueError(f"{arch}: quantization_config {quant.get('quant_method', quant)!r} is "
                         "not supported; load a bf16/fp32 checkpoint (e.g. dequantize FP8 first)")
    scoring, method = _ROUTING_DEFAULTS[arch]
    experts = c.get("n_routed_experts") or 0
    interleave = True if arch == "DeepseekV2ForCausalLM" else bool(c.get("rope_interleave", True))
    return dict(
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c.get("kv_lora_rank", 512),
        qk_nope_head_dim=c.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
        v_head_dim=c.get("v_head_dim", 128),
        rope_interleave=interleave,
        n_routed_experts=experts,
        num_experts_per_tok=(c.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=(c.get("moe_intermediate_size") or 0) if experts else 0,
        n_shared_experts=c.get("n_shared_experts") or 0,
        first_k_dense_replace=c.get("first_k_dense_replace") or 0,
        moe_layer_freq=c.get("moe_layer_freq") or 1,
        scoring_func=c.get("scoring_func") or scoring,
        topk_method=c.get("topk_method") or method,
        n_group=c.get("n_group"),
        topk_group=c.get("topk_group"),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
    )
