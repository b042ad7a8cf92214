"""parallelize(model, tp): swap a single-device TransformerLM's layers for their parallel
forms in place (torchtitan's `parallelize`, gpt-fast's tp.py). The model's forward is
untouched: attention runs on the rank's heads (its `heads`/`kv_heads` become local), the MLP
on its intermediate columns, and the swapped layers do the communication.

DeepSeek: latent attention on the rank's query heads (the latent projections stay whole,
so every rank computes and caches the whole latent), a mixture of experts as TP (each
expert's intermediate split) or EP (whole experts split), parallel/moe.py.

On a meta model (loading.py fills it afterwards) nothing is allocated; on a model with
weights, each rank keeps its slices (tests and small targets).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from inference_eval.engine.model.linear import Linear
from inference_eval.engine.model.mla import MLAttention
from inference_eval.engine.model.moe import Experts, MoE
from inference_eval.engine.model.transformer import TransformerLM
from inference_eval.engine.parallel.group import TPGroup
from inference_eval.engine.parallel.layers import (ColumnParallelLinear, ParallelLMHead,
                                                   RowParallelLinear, VocabParallelEmbedding)
from inference_eval.engine.parallel.moe import LocalExperts, ParallelMoE
from inference_eval.engine.parallel.shard import ShardPlan, ShardSpec


def parallelize(model: TransformerLM, tp: TPGroup, expert_parallel: bool = False) -> ShardPlan:
    """Shard `model` for rank tp.rank of tp.size in place; returns the plan (its
    local_arch() sizes the rank's KV cache). The model's `arch` stays the global one.
    expert_parallel: split a DeepSeek target's routed experts whole (engine.expert_parallel)."""
    arch = model.arch
    plan = ShardPlan(arch, tp.size, tp.rank, expert_parallel)
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
    attn = layer.self_attn
    ref = next(attn.parameters())
    kw = {"device": ref.device, "dtype": ref.dtype}
    if isinstance(attn, MLAttention):
        _parallelize_mla(attn, plan, specs, prefix + "self_attn.", tp, kw)
    else:
        _parallelize_attention(attn, plan, specs, prefix + "self_attn.", tp, kw)
    if isinstance(layer.mlp, MoE):
        layer.mlp = _parallelize_moe(layer.mlp, plan, specs, prefix + "mlp.", tp, kw)
    else:
        _parallelize_mlp(layer.mlp, plan.arch.hidden_size, specs, prefix + "mlp.", tp, kw)


def _parallelize_attention(attn: nn.Module, plan: ShardPlan, specs: dict[str, ShardSpec],
                           p: str, tp: TPGroup, kw: dict) -> None:
    arch, d = plan.arch, plan.arch.head_dim
    old = attn.qkv_proj
    rows = (plan.heads + 2 * plan.kv_heads) * d
    attn.qkv_proj = _fill(ColumnParallelLinear(old.in_features, rows,
                                               bias=old.bias is not None, **kw),
                          old, specs, p + "qkv_proj")
    attn.heads, attn.kv_heads = plan.heads, plan.kv_heads
    attn.q_size, attn.kv_size = plan.heads * d, plan.kv_heads * d
    attn.o_proj = _fill(RowParallelLinear(plan.heads * d, arch.hidden_size, tp, **kw),
                        attn.o_proj, specs, p + "o_proj")


def _parallelize_mla(attn: MLAttention, plan: ShardPlan, specs: dict[str, ShardSpec],
                     p: str, tp: TPGroup, kw: dict) -> None:
    """Query heads split; the latent rows of qkv_a_proj (c_kv, k_pe) and its norm whole."""
    a, h = plan.arch, plan.heads
    _, q_a = plan.mla_q_a()
    old = attn.qkv_a_proj
    attn.qkv_a_proj = _fill(ColumnParallelLinear(old.in_features, q_a + attn.r + attn.p,
                                                 bias=old.bias is not None, **kw),
                            old, specs, p + "qkv_a_proj")
    attn.q_a = q_a
    if attn.q_b_proj is not None:
        attn.q_b_proj = _fill(ColumnParallelLinear(a.q_lora_rank, h * a.qk_head_dim,
                                                   bias=False, **kw),
                              attn.q_b_proj, specs, p + "q_b_proj")
    attn.kv_b_proj = _fill(ColumnParallelLinear(attn.r, h * (attn.n + attn.v), bias=False, **kw),
                           attn.kv_b_proj, specs, p + "kv_b_proj")
    attn.o_proj = _fill(RowParallelLinear(h * attn.v, a.hidden_size, tp, **kw),
                        attn.o_proj, specs, p + "o_proj")
    attn.heads = h


def _parallelize_mlp(mlp: nn.Module, hidden: int, specs: dict[str, ShardSpec], p: str,
                     tp: TPGroup | None, kw: dict) -> None:
    """gate/up column-parallel, down row-parallel; tp None: down keeps its partial sum (the
    shared experts, whose sum rides on the MoE's all-reduce)."""
    inter = specs[p + "down_proj.weight"].index.numel()
    mlp.gate_up_proj = _fill(ColumnParallelLinear(hidden, 2 * inter, bias=False, **kw),
                             mlp.gate_up_proj, specs, p + "gate_up_proj")
    down = (RowParallelLinear(inter, hidden, tp, **kw) if tp is not None
            else Linear(inter, hidden, bias=False, **kw))
    mlp.down_proj = _fill(down, mlp.down_proj, specs, p + "down_proj")
    mlp.inter = inter


def _parallelize_moe(moe: MoE, plan: ShardPlan, specs: dict[str, ShardSpec], p: str,
                     tp: TPGroup, kw: dict) -> ParallelMoE:
    a = plan.arch
    if plan.expert_parallel:
        experts = LocalExperts(plan.experts, plan.expert_start, plan.moe_inter, a.hidden_size,
                               **kw)
    else:  # the model's own Experts, each with Im/T intermediate columns
        with torch.device(kw["device"]):
            experts = Experts(dataclasses.replace(a, moe_intermediate_size=plan.moe_inter))
        experts = experts.to(kw["dtype"])
    for leaf in ("gate_up_proj", "down_proj"):
        _fill_param(getattr(experts, leaf), getattr(moe.experts, leaf),
                    specs[p + "experts." + leaf])
    if moe.shared_experts is not None:
        _parallelize_mlp(moe.shared_experts, a.hidden_size, specs, p + "shared_experts.", None, kw)
    return ParallelMoE(moe.gate, experts, moe.shared_experts, tp)


def retie(model: TransformerLM) -> None:
    """Share the embedding's rows with a tied head again (to_empty() copies them apart)."""
    if model.arch.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def _fill(new: nn.Module, old: nn.Module, specs: dict[str, ShardSpec], prefix: str) -> nn.Module:
    for leaf in ("weight", "bias"):
        src = getattr(old, leaf, None)
        if src is not None:
            _fill_param(getattr(new, leaf), src, specs[f"{prefix}.{leaf}"])
    return new


def _fill_param(dst: torch.Tensor, src: torch.Tensor, spec: ShardSpec) -> None:
    """dst = this rank's slice of the full src (nothing to copy on a meta model)."""
    if not src.is_meta:
        dst.data.copy_(spec.take(src))


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (a tied head counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
