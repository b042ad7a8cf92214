"""Decoder-layer tensor names: our fused modules <-> the split names every engine loads.

Our layer fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (fewer GEMM
dispatches); HF, vLLM, SGLang, EAGLE and speculators checkpoints keep them split. The row
slices come from the adapter the target loader uses (`hf_name_to_ours`), so this split can
never disagree with how a target checkpoint is read.

DeepSeek layers (multi-head latent attention, MLA) go through the DeepSeek adapter
(model/deepseek_weights.py): q_a_proj (or q_proj) and kv_a_proj_with_mqa are fused into
`self_attn.qkv_a_proj`, and an interleaved checkpoint's rotary rows are reordered; writing
undoes both, so a written layer is byte-for-byte what a DeepSeek loader expects. Their MLP is
dense (gate/up/down_proj) or, for a head with `moe` (DeepSeek-V3/R1's own MTP layer), a
mixture of experts under the hub's per-expert names (`mlp.experts.{e}.{gate,up,down}_proj`,
`mlp.gate.weight` (+ `e_score_correction_bias`), `mlp.shared_experts.*`); reading also takes
transformers' fused `mlp.experts.gate_up_proj` / `down_proj`.
"""
from __future__ import annotations

import torch
from torch import nn

from heads.base import head_arch
from inference_eval.engine.model.arch import DEEPSEEK_ARCHITECTURES, ModelArch
from inference_eval.engine.model.deepseek_weights import deepseek_name_to_ours
from inference_eval.engine.model.layers import DecoderLayer
from inference_eval.engine.model.weights import hf_name_to_ours, load_hf_tensors

# Every tensor a Llama-family decoder layer can hold, in HF names relative to the layer.
HF_LAYER_LEAVES = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


# A DeepSeek layer with a dense MLP (a head's layer): q low-rank leaves or q_proj, per the arch.
_DEEPSEEK_Q_LORA = ("self_attn.q_a_proj.weight", "self_attn.q_a_proj.bias",
                    "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight")
_DEEPSEEK_Q_PLAIN = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_DEEPSEEK_REST = (
    "input_layernorm.weight",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias",
    "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight", "self_attn.o_proj.bias",
    "post_attention_layernorm.weight",
)
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_MOE_PREFIXES = ("mlp.experts.", "mlp.gate.", "mlp.shared_experts.")
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def is_deepseek(arch: ModelArch) -> bool:
    return arch.architecture in DEEPSEEK_ARCHITECTURES


def deepseek_layer_leaves(arch: ModelArch, fused_experts: bool = False) -> tuple[str, ...]:
    """Every tensor layer 0 of `arch` (a head's one-layer arch, heads.base.head_arch) can
    hold, in HF names relative to it: attention, then its dense or MoE MLP (per-expert names,
    or transformers' fused expert tensors with fused_experts)."""
    attn = (_DEEPSEEK_Q_LORA if arch.q_lora_rank is not None else _DEEPSEEK_Q_PLAIN) + _DEEPSEEK_REST
    if not arch.is_moe_layer(0):
        return attn + _DENSE_MLP
    experts = _FUSED_EXPERTS if fused_experts else tuple(
        f"mlp.experts.{e}.{p}.weight" for e in range(arch.n_routed_experts)
        for p in ("gate_proj", "up_proj", "down_proj"))
    router = ("mlp.gate.weight",) + (("mlp.gate.e_score_correction_bias",)
                                     if arch.scoring_func == "sigmoid" else ())
    shared = tuple(f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
                   ) if arch.n_shared_experts else ()
    return attn + router + experts + shared


def _has_moe_tensors(tensors, hf_prefix: str) -> bool:
    """Whether the layer under `hf_prefix` holds a mixture-of-experts MLP."""
    return any(n.startswith(hf_prefix) and n[len(hf_prefix):].startswith(_MOE_PREFIXES)
               for n in tensors)


def _ours(leaf: str, arch: ModelArch) -> tuple[str, slice | None]:
    """HF leaf -> (our name relative to the layer, row slice of our fused tensor)."""
    mapped = hf_name_to_ours(f"model.layers.0.{leaf}", arch)
    assert mapped is not None, leaf  # every HF_LAYER_LEAVES entry is a layer tensor
    name, rows = mapped
    return name.removeprefix("layers.0."), rows


def layer_to_hf(state: dict[str, torch.Tensor], ours_prefix: str, hf_prefix: str,
                arch: ModelArch) -> dict[str, torch.Tensor]:
    """Our layer tensors `state[ours_prefix + name]` -> {hf_prefix + leaf: tensor}.

    Fused [q; k; v] rows [q_size + 2 kv_size, in] and [gate; up] rows [2 I, H] are cut into
    contiguous copies; leaves whose source is absent (no input norm, no bias) are skipped.
    """
    if is_deepseek(arch):
        return _deepseek_layer_to_hf(state, ours_prefix, hf_prefix, arch)
    out = {}
    for leaf in HF_LAYER_LEAVES:
        name, rows = _ours(leaf, arch)
        t = state.get(ours_prefix + name)
        if t is not None:
            out[hf_prefix + leaf] = (t if rows is None else t[rows]).contiguous()
    return out


def layer_from_hf(tensors: dict[str, torch.Tensor], hf_prefix: str, ours_prefix: str,
                  arch: ModelArch, source: str) -> dict[str, torch.Tensor]:
    """Inverse of layer_to_hf: fuses {hf_prefix + leaf} into our names and REMOVES the
    consumed entries from `tensors`, so the caller can reject whatever is left over."""
    if is_deepseek(arch):
        return _deepseek_layer_from_hf(tensors, hf_prefix, ours_prefix, arch, source)
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    want: dict[str, int] = {}
    for leaf in HF_LAYER_LEAVES:
        name, rows = _ours(leaf, arch)
        want[name] = want.get(name, 0) + 1
        t = tensors.pop(hf_prefix + leaf, None)
        if t is None:
            continue
        if rows is not None and t.shape[0] != rows.stop - rows.start:
            raise ValueError(f"{source}: {hf_prefix + leaf} has {t.shape[0]} rows, but this "
                             f"architecture needs {rows.stop - rows.start}")
        pieces.setdefault(name, []).append((0 if rows is None else rows.start, t))
    out = {}
    for name, got in pieces.items():
        if len(got) != want[name]:  # e.g. q_proj and v_proj present but k_proj missing
            raise ValueError(f"{source}: only {len(got)} of the {want[name]} split tensors "
                             f"that make up {name} are present under {hf_prefix!r}")
        got.sort(key=lambda p: p[0])
        out[ours_prefix + name] = got[0][1] if len(got) == 1 else torch.cat([t for _, t in got])
    return out


def _deepseek_layer_to_hf(state: dict[str, torch.Tensor], ours_prefix: str, hf_prefix: str,
                          arch: ModelArch) -> dict[str, torch.Tensor]:
    a = head_arch(arch, ours_prefix + "mlp.experts.gate_up_proj" in state)
    out = {}
    for leaf in deepseek_layer_leaves(a):
        ours, index, transform = deepseek_name_to_ours(f"model.layers.0.{leaf}", a)
        t = state.get(ours_prefix + ours.removeprefix("layers.0."))
        if t is None:
            continue
        t = t if index is None else t[index]
        if transform is not None:  # a row permutation: write its inverse
            perm = transform(torch.arange(t.shape[0]).view(-1, 1).float()).view(-1).long()
            t = torch.empty_like(t).index_copy_(0, perm, t)
        out[hf_prefix + leaf] = t.contiguous()
    return out


def _deepseek_layer_from_hf(tensors: dict[str, torch.Tensor], hf_prefix: str, ours_prefix: str,
                            arch: ModelArch, source: str) -> dict[str, torch.Tensor]:
    """Loads the layer through the target's own adapter (load_hf_tensors), so every tensor
    of our layer must be present and of its shape; a missing one is named by its HF name.
    `arch` is the target's: the layer is an MoE layer with its experts when the tensors hold
    one (_has_moe_tensors), else dense."""
    moe = _has_moe_tensors(tensors, hf_prefix)
    if moe and arch.n_routed_experts == 0:
        raise ValueError(f"{source}: the layer under {hf_prefix!r} has a mixture-of-experts MLP, "
                         "but the target's config declares no routed experts (n_routed_experts "
                         "= 0): it is not a head for this target")
    a = head_arch(arch, moe)
    fused = hf_prefix + _FUSED_EXPERTS[0] in tensors
    need = [leaf for leaf in deepseek_layer_leaves(a, fused)
            if a.qkv_bias or not leaf.endswith(".bias")]
    missing = [hf_prefix + leaf for leaf in need if hf_prefix + leaf not in tensors]
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing}")
    taken = {f"model.layers.0.{leaf}": tensors.pop(hf_prefix + leaf) for leaf in need}
    holder = nn.Module()
    holder.layers = nn.ModuleList([DecoderLayer(a, 0)])
    holder.to(next(iter(taken.values())).dtype)
    load_hf_tensors(holder, a, ((n, (lambda t=t: t)) for n, t in taken.items()), source)
    return {ours_prefix + n.removeprefix("layers.0."): p.detach()
            for n, p in holder.named_parameters()}
