"""Multi-head latent attention (DeepSeek-V2/V3), in the absorbed-weight form.

Per token, MLA compresses keys and values into a latent c_kv [r] (r = kv_lora_rank, RMS-
normed) plus one rotary key k_pe [p] (p = qk_rope_head_dim) shared by all heads. Head h's
key is [W_uk[h] c_kv ; k_pe] and its value W_uv[h] c_kv, with W_uk [n, r], W_uv [v, r] the
rows of kv_b_proj (n = qk_nope_head_dim, v = v_head_dim). Since

    q_nope[h] · (W_uk[h] c) = (q_nope[h] W_uk[h]) · c      and      Σ_j a_j W_uv[h] c_j = W_uv[h] Σ_j a_j c_j,

we fold W_uk into the query and W_uv into the output, and attention becomes multi-query
attention over the cached rows [c_kv ; k_pe] (width r + p, one "head") whose values are the
rows' first r columns. The cache therefore stores only r + p numbers per token and layer,
prefill and decode run the same code, and the attention backends see an ordinary MQA call
(`StepContext.attend_latent`). Expanding keys for long prefills (fewer FLOPs when
n + p << r + p) is a later optimisation; both forms give the reference's numbers.

Rotary: our tables are rotate-half; interleaved checkpoints (all of V2, V3 by default) get
their rotary rows permuted at load (model/deepseek_weights.py), which leaves every q · k
unchanged. Softmax scale: 1 / sqrt(n + p), times mscale(factor, mscale_all_dim)^2 under YaRN
(DeepSeek's correction for the longer context; the cos/sin tables carry the other factor).
"""
from __future__ import annotations

import torch
from torch import nn

from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.linear import Linear
from inference_eval.engine.model.norm import RMSNorm
from inference_eval.engine.model.rope import apply_rope, yarn_factor, yarn_mscale

LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(arch: ModelArch) -> float:
    scale = arch.qk_head_dim ** -0.5
    s = arch.rope_scaling or {}
    if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
        m = yarn_mscale(yarn_factor(s, arch.max_position_embeddings), float(s["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    """Named like transformers' DeepSeek attention, except that q_a_proj (or q_proj without
    a q low-rank path) and kv_a_proj_with_mqa are fused into `qkv_a_proj`: both read x, and
    one GEMM costs one dispatch."""

    def __init__(self, arch: ModelArch, layer: int, in_features: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.heads = arch.num_heads
        self.r, self.p = arch.kv_lora_rank, arch.qk_rope_head_dim
        self.n, self.v = arch.qk_nope_head_dim, arch.v_head_dim
        q_width = arch.num_heads * arch.qk_head_dim
        self.q_a = arch.q_lora_rank or q_width  # first output block of qkv_a_proj
        bias = arch.qkv_bias
        self.qkv_a_proj = Linear(in_features or arch.hidden_size, self.q_a + self.r + self.p,
                                 bias=bias)
        # DeepSeek's code (and transformers') builds the latent norms with RMSNorm's default
        # eps 1e-6, not rms_norm_eps; released configs set both to 1e-6 anyway.
        if arch.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(arch.q_lora_rank, q_width, bias=False)
        else:
            self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.r, arch.num_heads * (self.n + self.v), bias=False)
        self.o_proj = Linear(arch.num_heads * self.v, arch.hidden_size, bias=bias)
        self.scale = mla_softmax_scale(arch)

    def forward(self, x: torch.Tensor, ctx, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in_features] -> [T, H] ([R, H] for rows [R] only); appends [c_kv ; k_pe]
        [T, 1, r + p] to the cache."""
        t = x.shape[0]
        q, c, k_pe = self.qkv_a_proj(x).split([self.q_a, self.r, self.p], dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.heads, self.n + self.p)
        q_nope, q_pe = q.split([self.n, self.p], dim=-1)
        q_pe = apply_rope(q_pe, ctx.cos, ctx.sin)
        k_pe = apply_rope(k_pe.view(t, 1, self.p), ctx.cos, ctx.sin)
        # kv_b_proj rows per head: [W_uk (n rows); W_uv (v rows)], each [., r].
        w = self.kv_b_proj.weight.unflatten(0, (self.heads, self.n + self.v))
        w_uk, w_uv = w[:, :self.n], w[:, self.n:]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        latent = torch.cat([self.kv_a_layernorm(c).view(t, 1, self.r), k_pe], dim=-1)
        o_lat = ctx.attend_latent(self.layer, torch.cat([q_lat, q_pe], dim=-1), latent,
                                  self.r, self.scale)
        if rows is not None:
            o_lat, t = o_lat.index_select(0, rows), rows.shape[0]
        out = torch.einsum("thr,hvr->thv", o_lat, w_uv)
        return self.o_proj(out.reshape(t, self.heads * self.v))

