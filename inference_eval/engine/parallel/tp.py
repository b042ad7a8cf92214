"""parallelize(model, tp): swap a single-device TransformerLM's layers for their parallel
forms in place (torchtitan's `parallelize`, gpt-fast's tp.py). The model's forward is
untouched: attention runs on the rank's heads (its `heads`/`kv_heads` become local), the MLP
on its intermediate columns, and the swapped layers do the communication.

On a meta model (loading.py fills it afterwards) nothing is allocated; on a model with
weights, each rank keeps its slices (tests and small targets).
"""
from __future__ import annotations

import torch
from torch import nn

from inference_eval.engine.model.transformer import TransformerLM
from inference_eval.engine.parallel.group import TPGroup
from inference_eval.engine.parallel.layers import (ColumnParallelLinear, ParallelLMHead,
                                                   RowParallelLinear, VocabParallelEmbedding)
from inference_eval.engine.parallel.shard import ShardPlan, ShardSpec


def parallelize(model: TransformerLM, tp: TPGroup) -> ShardPlan:
    """Shard `model` for rank tp.rank of tp.size in place; returns the plan (its
    local_arch() sizes the rank's KV cache). The model's `arch` stays the global one."""
    arch = model.arch
    plan = ShardPlan(arch, tp.size, tp.rank)
    specs = plan.specs()
    ref = model.embed_tokens.weight
    kw = {"device": ref.device, "dtype": ref.dtype}
    with torch.no_grad():
        for n, layer in enumerate(model.layers):
            parallelize_layer(layer, plan, specs, f"layers.{n}.", tp)
        rows = plan.vocab_per_rank
        emb = _fill(VocabParallelEmbedding(rows, arch.hidden_size, plan.vocab_start,
                                           arch.vocab_size, tp, **kw),
                    model.embed_tokens, specs, "embed_tokens")
        head = ParallelLMHead(arch.hidden_size, rows, arch.vocab_size, tp, **kw)
        if model.lm_head is None:  # tied: the head reads the embedding's local rows
            head.weight = emb.weight
        else:
            _fill(head, model.lm_head, specs, "lm_head")
        model.embed_tokens, model.lm_head = emb, head
    model.requires_grad_(False)
    return plan


def parallelize_layer(layer: nn.Module, plan: ShardPlan, specs: dict[str, ShardSpec],
                      prefix: str, tp: TPGroup) -> None:
    """One decoder layer (the target's, or a draft head's, whose attention has the target's
    shape) in place: qkv and gate/up column-parallel, o and down row-parallel (one all-reduce
    each), attention on the rank's local heads. prefix: the layer's name in `specs`."""
    arch, d = plan.arch, plan.arch.head_dim
    attn, mlp = layer.self_attn, layer.mlp
    ref = attn.qkv_proj.weight
    kw = {"device": ref.device, "dtype": ref.dtype}
    old = attn.qkv_proj
    rows = (plan.heads + 2 * plan.kv_heads) * d
    attn.qkv_proj = _fill(ColumnParallelLinear(old.in_features, rows,
                                               bias=old.bias is not None, **kw),
                          old, specs, prefix + "self_attn.qkv_proj")
    attn.heads, attn.kv_heads = plan.heads, plan.kv_heads
    attn.q_size, attn.kv_size = plan.heads * d, plan.kv_heads * d
    attn.o_proj = _fill(RowParallelLinear(plan.heads * d, arch.hidden_size, tp, **kw),
                        attn.o_proj, specs, prefix + "self_attn.o_proj")
    mlp.gate_up_proj = _fill(ColumnParallelLinear(arch.hidden_size, 2 * plan.inter,
                                                  bias=False, **kw),
                             mlp.gate_up_proj, specs, prefix + "mlp.gate_up_proj")
    mlp.down_proj = _fill(RowParallelLinear(plan.inter, arch.hidden_size, tp, **kw),
                          mlp.down_proj, specs, prefix + "mlp.down_proj")
    mlp.inter = plan.inter


def retie(model: TransformerLM) -> None:
    """Share the embedding's rows with a tied head again (to_empty() copies them apart)."""
    if model.arch.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def _fill(new: nn.Module, old: nn.Module, specs: dict[str, ShardSpec], prefix: str) -> nn.Module:
    for leaf in ("weight", "bias"):
        src = getattr(old, leaf, None)
        if src is None or src.is_meta:
            continue
        getattr(new, leaf).copy_(specs[f"{prefix}.{leaf}"].take(src))
    return new


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (a tied head counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
