"""Decoder-layer tensor names: our fused modules <-> the split names every engine loads.

Our layer fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (fewer GEMM
dispatches); HF, vLLM, SGLang, EAGLE and speculators checkpoints keep them split. The row
slices come from the adapter the target loader uses (`hf_name_to_ours`), so this split can
never disagree with how a target checkpoint is read.
"""
from __future__ import annotations

import torch

from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.weights import hf_name_to_ours

# Every tensor a Llama-family decoder layer can hold, in HF names relative to the layer.
HF_LAYER_LEAVES = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


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
