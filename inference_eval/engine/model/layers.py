"""The one decoder layer that target and draft models share, so a head drafts with exactly the
target's layer arithmetic and a fix to it reaches both.

Its attention is grouped-query attention (Llama family) or multi-head latent attention
(DeepSeek, model/mla.py); its MLP is a SwiGLU MLP or a mixture of experts (model/moe.py),
chosen per layer by the arch. State-dict names stay `self_attn.*` and `mlp.*` either way.

Tensors are packed: T tokens of all requests in a step, laid end to end, no padding.
Attention is delegated to `ctx.attend`, a per-step object planned once by an attention
backend (torch SDPA, FlashInfer, or cacheless packed attention for training/precompute).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from inference_eval.engine.model import cpu_fused
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.linear import Linear
from inference_eval.engine.model.mla import MLAttention
from inference_eval.engine.model.mlp import MLP
from inference_eval.engine.model.moe import MoE
from inference_eval.engine.model.norm import RMSNorm
from inference_eval.engine.model.rope import apply_rope

__all__ = ["AttentionContext", "Attention", "DecoderLayer", "MLP", "RMSNorm"]


class AttentionContext(Protocol):
    """What a layer needs from the step: rotary tables for its tokens and an attention call."""

    cos: torch.Tensor  # [T, head_dim] fp32
    sin: torch.Tensor  # [T, head_dim] fp32

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] (new tokens) -> [T, heads, d]."""
        ...

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, v_dim: int,
                      scale: float) -> torch.Tensor:
        """MLA as multi-query attention: q [T, heads, D], latent [T, 1, D] (new tokens' cache
        rows, D = kv_lora_rank + rope) -> [T, heads, v_dim], values = rows[:, :v_dim]."""
        ...


class Attention(nn.Module):
    cpu_blas: bool = False  # the CPU fast path (linear.set_cpu_blas): cpu_fused's rope

    def __init__(self, arch: ModelArch, layer: int, in_features: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        # One fused projection: three small GEMMs cost three dispatches per layer at decode.
        self.qkv_proj = Linear(in_features or arch.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, ctx: AttentionContext,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in_features] -> [T, H], or [R, H] for rows [R] only (every row's keys and
        values still reach the cache and the attention)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qn, kn = self.q_norm, self.k_norm
        norms = () if qn is None else (qn.weight, kn.weight)
        if self.cpu_blas and cpu_fused.applies(qkv, ctx.cos, *norms):
            # q/k-normed layers (Qwen3, DFlash) norm each head's row inside the same pass.
            q, k, v = cpu_fused.rope_split(qkv, ctx.cos, ctx.sin, self.heads, self.kv_heads,
                                           self.head_dim, *norms, eps=getattr(qn, "eps", 1e-6))
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.heads, self.head_dim)
            k = k.view(t, self.kv_heads, self.head_dim)
            v = v.view(t, self.kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        out = ctx.attend(self.layer, q, k, v).reshape(t, self.q_size)
        return self.o_proj(out if rows is None else out.index_select(0, rows))


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with residuals.

    `input_norm=False` gives the EAGLE-1 layout (its fused input is not normalized);
    `attn_in_features` widens the attention input (EAGLE-3 feeds [emb; hidden], 2H).
    """

    def __init__(self, arch: ModelArch, layer: int, *, input_norm: bool = True,
                 attn_in_features: int | None = None) -> None:
        super().__init__()
        width = attn_in_features or arch.hidden_size
        self.input_layernorm = RMSNorm(width, arch.rms_norm_eps) if input_norm else None
        attn = MLAttention if arch.is_mla else Attention
        self.self_attn = attn(arch, layer, attn_in_features)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MoE(arch) if arch.is_moe_layer(layer) else MLP(arch)

    def forward(self, x: torch.Tensor, ctx: AttentionContext,
                residual: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, width] -> [T, H]. `residual` [T, H] defaults to x (differs only when widened).
        rows [R]: only these rows' outputs are wanted -> [R, H]; every row still writes its
        keys and values, and the rest of the layer (o_proj, MLP) runs on the R rows only (a
        block drafter's last layer, whose anchor row feeds no logits)."""
        residual = x if residual is None else residual
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        if rows is None:
            a = self.self_attn(h, ctx)
        else:
            a, residual = self.self_attn(h, ctx, rows), residual.index_select(0, rows)
        norm = self.post_attention_layernorm
        if norm.cpu_blas and cpu_fused.applies(a, residual, norm.weight):
            h, normed = cpu_fused.rms_norm(a, norm.weight, norm.eps, residual)  # one pass
        else:
            h = residual + a
            normed = norm(h)
        return h + self.mlp(normed)
