"""MLA (absorbed form) on the torch backend: multi-query attention over latent cache rows.

After absorption (model/mla.py) a DeepSeek layer's attention is MQA: queries [T, heads, D]
against one shared key row per token [c_kv ; k_pe] (D = kv_lora_rank + qk_rope_head_dim)
whose values are the row's first kv_lora_rank columns. The torch plan's `attend` already
does paged append + gather + SDPA with one kv head; we hand it the latent rows as both keys
and values (a latent KVCache aliases its value storage to its key storage, so the append
writes one row) and keep the value columns of the output. SDPA's default scale is
1/sqrt(D), so the query is pre-multiplied to give MLA's own softmax scale.

Cost of the reuse: the value gather reads the same rows again and SDPA's value product is
D wide instead of kv_lora_rank (+12.5% at DeepSeek's 512 + 64); a dedicated latent kernel
(FlashInfer MLA on GPU) removes both.
"""
from __future__ import annotations

import math

import torch

from inference_eval.engine.attention.torch_backend import TorchAttentionPlan


def mla_attend(plan, layer: int, q: torch.Tensor, latent: torch.Tensor, cache,
               v_dim: int, scale: float) -> torch.Tensor:
    """q [T, heads, D], latent [T, 1, D] (this step's cache rows) -> [T, heads, v_dim].

    `cache`: a KVCache (a latent one from KVCache.for_arch, or any whose rows are D wide) or
    None for cacheless layouts. Raises NotImplementedError for non-torch plans."""
    if not isinstance(plan, TorchAttentionPlan):
        raise NotImplementedError(
            f"multi-head latent attention (DeepSeek) runs on the torch attention backend only; "
            f"{type(plan).__name__} has no MLA kernel yet (FlashInfer MLA is not implemented): "
            "set engine.attention=torch")
    q = q * (scale * math.sqrt(q.shape[-1]))
    return plan.attend(layer, q, latent, latent, cache)[..., :v_dim]
