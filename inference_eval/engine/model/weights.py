"""Weight-name adapter: Hugging Face Llama-family tensor names -> our fused modules.

(DeepSeek names: model/deepseek_weights.py; `load_hf_tensors` here serves both.)

HF keeps q/k/v and gate/up as separate matrices; we fuse them (fewer GEMM dispatches), so
each HF tensor maps to (our parameter, row slice). Streaming one tensor at a time lets a
sharded 70B checkpoint load without materializing a second copy.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

import torch
from torch import nn

from inference_eval.engine.model.arch import DEEPSEEK_ARCHITECTURES, ModelArch

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def hf_name_to_ours(name: str, arch: ModelArch) -> tuple[str, slice | None] | None:
    """Map an HF tensor name to (our parameter name, row slice into it); None = not ours."""
    q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
    direct = {
        "model.embed_tokens.weight": "embed_tokens.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if name in direct:
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            return None
        return direct[name], None
    m = _LAYER.match(name)
    if not m:
        return None
    i, rest = m.group(1), m.group(2)
    kind, _, leaf = rest.rpartition(".")
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
    }
    if kind in fused:
        target, rows = fused[kind]
        return f"layers.{i}.{target}.{leaf}", rows
    plain = {"self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.down_proj",
             "input_layernorm", "post_attention_layernorm"}
    if kind in plain:
        return f"layers.{i}.{rest}", None
    return None


def load_hf_tensors(model: nn.Module, arch: ModelArch,
                    tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]],
                    source: str) -> None:
    """Copy (name, lazy tensor) pairs into `model`; every parameter must be covered exactly.

    Raises naming `source` and the missing/unexpected tensors, so a partial or foreign
    checkpoint never yields a silently half-random model. DeepSeek checkpoints go through
    model/deepseek_weights.py (experts, latent attention, rotary row order).
    """
    if arch.architecture in DEEPSEEK_ARCHITECTURES:
        from inference_eval.engine.model.deepseek_weights import deepseek_name_to_ours as mapper
    else:
        def mapper(name: str, arch: ModelArch):
            mapped = hf_name_to_ours(name, arch)
            return None if mapped is None else (*mapped, None)
    params = dict(model.named_parameters())
    # Which rows (and, for [E, rows, cols] experts, which expert rows) have been written.
    cover = {n: torch.zeros(p.shape[:2] if p.dim() == 3 else p.shape[:1], dtype=torch.bool)
             for n, p in params.items()}
    for name, get in tensors:
        try:
            mapped = mapper(name, arch)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        if mapped is None:
            continue
        ours, index, transform = mapped
        if ours not in params:
            raise ValueError(f"{source}: tensor {name!r} maps to {ours!r}, which this "
                             f"{arch.architecture} config does not have")
        p = params[ours]
        t = get()
        if transform is not None:
            t = transform(t)
        dst = p.data if index is None else p.data[index]
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, "
                             f"expected {tuple(dst.shape)} for {ours}")
        dst.copy_(t.to(dst.dtype))
        if index is None:
            cover[ours][...] = True
        else:
            cover[ours][index] = True
    missing = [_describe_gap(n, c) for n, c in cover.items() if not bool(c.all())]
    if missing:
        raise ValueError(f"{source}: checkpoint lacks tensors for {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}")


def _describe_gap(name: str, cover: torch.Tensor) -> str:
    """Our parameter name, plus the routed experts left unfilled for [E, ...] expert tensors."""
    if cover.dim() < 2:
        return name
    experts = (~cover).any(dim=1).nonzero().flatten().tolist()
    shown = ", ".join(map(str, experts[:8])) + (" ..." if len(experts) > 8 else "")
    return f"{name} (experts {shown}: mlp.experts.<e>.*_proj.weight)"
