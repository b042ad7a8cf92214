"""MLA (absorbed form) on the torch backend: multi-query attention over latent cache rows.

After absorption (model/mla.py) a DeepSeek layer's attention is MQA: queries [T, heads, D]
against one shared key row per token [c_kv ; k_pe] (D = kv_lora_rank + qk_rope_head_dim)
whose values are the row's first kv_lora_rank columns. Every attention plan answers this
call with its own `attend_latent(layer, q, latent, cache, v_dim, scale)` (one interface per
role; FlashInfer's lives in flashinfer_mla.py): the model's StepContext calls it.

The torch plan's version (`torch_attend_latent`, here) reuses its ordinary `attend`: paged
append + gather + SDPA with one kv head, handed the latent rows as both keys and values (a
latent KVCache aliases its value storage to its key storage, so the append writes one row),
keeping the value columns of the output. SDPA's default scale is 1/sqrt(D), so the query is
pre-multiplied to give MLA's own softmax scale.

Cost of the reuse: the value gather reads the same rows again and SDPA's value product is
D wide instead of kv_lora_rank (+12.5% at DeepSeek's 512 + 64); a dedicated latent kernel
(FlashInfer MLA on GPU, flashinfer_mla.py) removes both.
"""
from __future__ import annotations

import math

import torch


def torch_attend_latent(plan, layer: int, q: torch.Tensor, latent: torch.Tensor, cache,
                        v_dim: int, scale: float) -> torch.Tensor:
    """TorchAttentionPlan.attend_latent: q [T, heads, D], latent [T, 1, D] -> [T, heads,
    v_dim] in q's dtype, via `plan.attend` (appends `latent` to `cache` when paged)."""
    q = q * (scale * math.sqrt(q.shape[-1]))
    return plan.attend(layer, q, latent, latent, cache)[..., :v_dim]
