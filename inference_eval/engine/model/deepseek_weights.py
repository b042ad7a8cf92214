"""Weight-name adapter: DeepSeek-V2/V3 Hugging Face tensor names -> our modules.

Reads both layouts a DeepSeek checkpoint comes in: per-expert tensors
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, DeepSeek's hub files and what transformers'
save_pretrained writes) and transformers' in-memory fused experts (`mlp.experts.gate_up_proj`
[E, 2 I, H], `mlp.experts.down_proj` [E, H, I]). Each HF tensor maps to (our parameter, an
index into it, an optional transform of the HF tensor).

Fusions: q_a_proj (or q_proj) and kv_a_proj_with_mqa -> `self_attn.qkv_a_proj` rows
[q block; c_kv (r); k_pe (p)]; gate/up -> `gate_up_proj`, per expert for routed experts.

Rotary rows: an interleaved checkpoint rotates pairs (x0, x1), (x2, x3), ...; our rope is
rotate-half, pairing x_i with x_{i + p/2}. Reordering the p rotary output rows of every query
head and of k_pe as [x0, x2, x4, ..., x1, x3, ...] makes rotate-half rotate exactly the
original pairs, and q and k get the same order, so every q · k equals the reference's:

    p = 4: HF rows (x0, x1, x2, x3) -> ours (x0, x2, x1, x3); rotate-half pairs (x0, x1), (x2, x3)

Layers at index >= num_layers (DeepSeek-V3's MTP module, model.layers.61) are skipped; FP8
block-quantized checkpoints (`*.weight_scale_inv`) are refused by name.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from inference_eval.engine.model.arch import ModelArch

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

Index = slice | tuple | None
Transform = Callable[[torch.Tensor], torch.Tensor] | None


def rope_pair_order(p: int) -> torch.Tensor:
    """[p] int64: interleaved pair layout -> rotate-half layout (evens, then odds)."""
    return torch.cat([torch.arange(0, p, 2), torch.arange(1, p, 2)])


def _permute_q_heads(arch: ModelArch) -> Transform:
    """Rows [heads * (n + p), ...]: reorder the last p rows of every head."""
    if not arch.rope_interleave:
        return None
    n, p, order = arch.qk_nope_head_dim, arch.qk_rope_head_dim, rope_pair_order(arch.qk_rope_head_dim)

    def f(t: torch.Tensor) -> torch.Tensor:
        w = t.reshape(arch.num_heads, n + p, *t.shape[1:]).clone()
        w[:, n:] = w[:, n:][:, order]
        return w.reshape(t.shape)

    return f


def _permute_kv_a(arch: ModelArch) -> Transform:
    """Rows [r + p, ...]: reorder the k_pe rows r..r+p."""
    if not arch.rope_interleave:
        return None
    r, order = arch.kv_lora_rank, rope_pair_order(arch.qk_rope_head_dim)

    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[r:] = t[r:][order]
        return t

    return f


def deepseek_name_to_ours(name: str, arch: ModelArch) -> tuple[str, Index, Transform] | None:
    """HF tensor name -> (our parameter, index into it, transform of the HF tensor); None =
    not part of our model. Raises ValueError for tensors we cannot run (FP8 scales)."""
    if name.endswith("weight_scale_inv"):
        raise ValueError(f"tensor {name!r}: FP8 block-quantized weights are not supported; "
                         "load a bf16 checkpoint (dequantize first)")
    direct = {"model.embed_tokens.weight": "embed_tokens.weight",
              "model.norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    if name in direct:
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            return None
        return direct[name], None, None
    m = _LAYER.match(name)
    if not m or int(m.group(1)) >= arch.num_layers:
        return None
    pre, rest = f"layers.{m.group(1)}.", m.group(2)
    q_a = arch.q_lora_rank or arch.num_heads * arch.qk_head_dim
    r, p = arch.kv_lora_rank, arch.qk_rope_head_dim
    kind, _, leaf = rest.rpartition(".")
    attn = {
        "self_attn.q_proj": ("self_attn.qkv_a_proj", slice(0, q_a), _permute_q_heads(arch)),
        "self_attn.q_a_proj": ("self_attn.qkv_a_proj", slice(0, q_a), None),
        "self_attn.kv_a_proj_with_mqa": ("self_attn.qkv_a_proj", slice(q_a, q_a + r + p),
                                         _permute_kv_a(arch)),
        "self_attn.q_b_proj": ("self_attn.q_b_proj", None, _permute_q_heads(arch)),
    }
    if kind in attn:
        ours, index, transform = attn[kind]
        return f"{pre}{ours}.{leaf}", index, transform
    plain = {"self_attn.q_a_layernorm", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
             "self_attn.o_proj", "input_layernorm", "post_attention_layernorm",
             "mlp.down_proj", "mlp.shared_experts.down_proj", "mlp.gate"}
    if kind in plain:
        return pre + rest, None, None
    for mlp, inter in (("mlp", arch.intermediate_size),
                       ("mlp.shared_experts", arch.n_shared_experts * arch.moe_intermediate_size)):
        if kind in (f"{mlp}.gate_proj", f"{mlp}.up_proj"):
            rows = slice(0, inter) if kind.endswith("gate_proj") else slice(inter, 2 * inter)
            return f"{pre}{mlp}.gate_up_proj.{leaf}", rows, None
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # transformers' fused form
        return pre + rest, None, None
    e = _EXPERT.match(rest)
    if e:
        expert, proj, inter = int(e.group(1)), e.group(2), arch.moe_intermediate_size
        if proj == "down_proj":
            return f"{pre}mlp.experts.down_proj", (expert,), None
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        return f"{pre}mlp.experts.gate_up_proj", (expert, rows), None
    return None
