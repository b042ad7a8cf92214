"""The EAGLE-3 format SGLang and TensorRT-LLM load (`LlamaForCausalLMEagle3`), also vLLM's
`Eagle3LlamaForCausalLM`; the tensor mapping is shared with the speculators format.

    config.json        Llama config of one layer, draft_vocab_size (null = full vocabulary,
                       lm_head shared from the target), aux layer ids (top level and in
                       eagle_config: vLLM and SGLang read one or the other)
    model.safetensors  fc.weight [H, 3H]; midlayer.{input_layernorm (embedding norm),
                       hidden_norm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
                       mlp.{gate,up,down}_proj}; norm.weight; reduced vocabulary only:
                       lm_head.weight [V_draft, H], d2t [V_draft] int64, t2d [V] bool

Conventions read from the engines' loaders:
  * d2t holds OFFSETS: target id = draft id + d2t[draft id] (SGLang hot_token_id, vLLM
    draft_id_to_target_id); ours stores absolute ids (`d2t_ids`).
  * aux layer ids count HF hidden_states (0 = embeddings; id i is the input of layer i), so
    engine id = our layer id + 1 (ours index layer outputs).
  * the residual of the layer is the UN-normalized hidden (norm_before_residual = false).
  * vLLM and SGLang build fc with exactly 3 x H inputs and a Llama layer without q/k/v bias
    or q/k norms, so heads of other shapes are refused rather than silently mis-served.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from heads.formats.bundle import (HeadBundle, arch_from_config, cfg_from_stamp, dtype_name,
                                 has_architecture, llama_layer_config,
                                 read_one_layer_config, read_tensors,
                                 refuse_unused, stamps, write_dir)
from heads.formats.layer_names import layer_from_hf, layer_to_hf

NAME = "eagle3"
HEAD_TYPES = ("eagle3",)
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
LAYER_PREFIX = "midlayer."


def check_expressible(bundle: HeadBundle, fmt: str) -> None:
    a, n_aux = bundle.arch, len(bundle.cfg.aux_layers)
    if a.qkv_bias or a.qk_norm:
        raise ValueError(f"format {fmt!r} holds a Llama-layout layer without q/k/v bias or q/k "
                         f"norms, but this head's layer (target {a.architecture}) has "
                         f"{'q/k/v bias' if a.qkv_bias else 'q/k norms'}")
    if n_aux != 3:
        raise ValueError(f"format {fmt!r}: vLLM and SGLang fuse exactly 3 auxiliary layers "
                         f"(fc is 3H -> H), this head fuses {n_aux} ({bundle.cfg.aux_layers})")


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """A reduced vocabulary's target ids [V_draft] -> {"d2t": offsets [V_draft] int64,
    "t2d": [V] bool}, as the EAGLE-3 and speculators formats store them."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def deep_layer_names(num_layers: int) -> list[tuple[str, str]]:
    """(our prefix, speculators' prefix) of a multi-layer head's plain layers 1..N-1."""
    return [(f"deep_layers.{i - 1}.", f"layers.{i}.") for i in range(1, num_layers)]


def to_tensors(bundle: HeadBundle, layer_prefix: str) -> dict[str, torch.Tensor]:
    """Our eagle3 state -> EAGLE-3 tensor names (the first layer under `layer_prefix`, the
    plain layers of a multi-layer head under speculators' `layers.{i}.`)."""
    s = dict(bundle.state)
    out = {"fc.weight": s.pop("fc.weight"), "norm.weight": s.pop("final_norm.weight"),
           f"{layer_prefix}input_layernorm.weight": s.pop("input_norm.weight"),
           f"{layer_prefix}hidden_norm.weight": s.pop("hidden_norm.weight")}
    out.update(layer_to_hf(s, "layer.", layer_prefix, bundle.arch))
    for ours, theirs in deep_layer_names(bundle.cfg.num_layers):
        out.update(layer_to_hf(s, ours, theirs, bundle.arch))
    for k in [k for k in s if k.startswith(("layer.", "deep_layers."))]:
        s.pop(k)
    if "draft_lm_head" in s:
        out["lm_head.weight"] = s.pop("draft_lm_head")
        out.update(vocab_maps(s.pop("d2t_ids").long(), bundle.arch.vocab_size))
    assert not s, f"eagle3 tensors without an EAGLE-3 name: {sorted(s)}"
    return out


def from_tensors(tensors: dict[str, torch.Tensor], layer_prefix: str, bundle: HeadBundle,
                 fmt: str, declared_vocab: int | None) -> None:
    """EAGLE-3 tensors -> bundle.state (our names), bundle.embed and the draft vocabulary size
    in bundle.cfg (whose num_layers says how many layers to read); refuses any tensor left
    over. `declared_vocab`: the config's draft_vocab_size (None or V = full vocabulary unless
    an lm_head is present)."""
    t, src, v = dict(tensors), bundle.source, bundle.arch.vocab_size
    need = ["fc.weight", "norm.weight", f"{layer_prefix}input_layernorm.weight",
            f"{layer_prefix}hidden_norm.weight"]
    missing = [k for k in need if k not in t]
    if missing:
        raise ValueError(f"{src}: not an EAGLE-3 head, missing {missing}")
    state = {"fc.weight": t.pop("fc.weight"), "final_norm.weight": t.pop("norm.weight"),
             "input_norm.weight": t.pop(f"{layer_prefix}input_layernorm.weight"),
             "hidden_norm.weight": t.pop(f"{layer_prefix}hidden_norm.weight")}
    state.update(layer_from_hf(t, layer_prefix, "layer.", bundle.arch, src))
    for ours, theirs in deep_layer_names(bundle.cfg.num_layers):
        if f"{theirs}self_attn.o_proj.weight" not in t:
            raise ValueError(f"{src}: its config declares {bundle.cfg.num_layers} draft layers, "
                             f"but {theirs}* is missing")
        state.update(layer_from_hf(t, theirs, ours, bundle.arch, src))
    bundle.embed = t.pop("embed_tokens.weight", None)
    d2t, t2d, lm_head = t.pop("d2t", None), t.pop("t2d", None), t.pop("lm_head.weight", None)
    refuse_unused(t, src, fmt)
    if lm_head is not None:
        vd = lm_head.shape[0]
        ids = torch.arange(vd) if d2t is None else d2t.long() + torch.arange(vd)
        if d2t is None and vd != v:
            raise ValueError(f"{src}: lm_head has {vd} rows but there is no d2t map")
        if ids.numel() != vd or ids.min() < 0 or ids.max() >= v or ids.unique().numel() != vd:
            raise ValueError(f"{src}: d2t does not map {vd} draft ids to distinct target ids")
        if t2d is not None and not torch.equal(t2d.bool().nonzero().flatten(), ids.sort().values):
            raise ValueError(f"{src}: t2d and d2t disagree on the draft vocabulary")
        state["draft_lm_head"], state["d2t_ids"] = lm_head, ids
    elif declared_vocab not in (None, v):
        raise ValueError(f"{src}: draft_vocab_size={declared_vocab} but the checkpoint has no "
                         "lm_head.weight")
    bundle.state = state
    bundle.cfg = replace(bundle.cfg, draft_vocab_size=None if lm_head is None else lm_head.shape[0])


def engine_aux_ids(bundle: HeadBundle) -> list[int]:
    return [i + 1 for i in bundle.cfg.aux_layers]


def our_aux_ids(engine_ids: list[int] | None, source: str) -> list[int]:
    """Engine ids (HF hidden_states index) -> our layer-output ids; [] = engine default."""
    if not engine_ids:
        return []
    if min(engine_ids) < 1:
        raise ValueError(f"{source}: auxiliary id 0 is the embedding output, which our "
                         "precompute does not capture")
    return [i - 1 for i in engine_ids]


def export(bundle: HeadBundle, out: Path, verifier: str | None = None) -> Path:
    if bundle.cfg.parallel_drafting:
        raise ValueError("format 'eagle3' has no P-EAGLE variant (mask_hidden); export a "
                         "head.parallel_drafting head to format 'speculators' (peagle)")
    if bundle.cfg.num_layers > 1:
        raise ValueError(f"format 'eagle3' holds one draft layer (midlayer), this head has "
                         f"{bundle.cfg.num_layers}; export it to format 'speculators', whose "
                         "EAGLE-3 has any number")
    check_expressible(bundle, NAME)
    tensors = to_tensors(bundle, LAYER_PREFIX)
    reduced = "lm_head.weight" in tensors
    aux = engine_aux_ids(bundle)
    config = llama_layer_config(
        bundle.arch, architectures=["LlamaForCausalLMEagle3"], torch_dtype=dtype_name(tensors),
        # SGLang ties lm_head to embed_tokens when this is set; a reduced head owns its lm_head.
        tie_word_embeddings=bundle.arch.tie_word_embeddings and not reduced,
        draft_vocab_size=tensors["lm_head.weight"].shape[0] if reduced else None,
        norm_before_residual=False, eagle_aux_hidden_state_layer_ids=aux,
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        **stamps(bundle, verifier))
    return write_dir(out, config, tensors)


def detect(cfg: dict[str, Any]) -> bool:
    return has_architecture(cfg, ARCHITECTURES)


def read(path: Path) -> HeadBundle:
    cfg = read_one_layer_config(path, "eagle3")
    if cfg.get("norm_before_residual"):
        raise ValueError(f"{path}: norm_before_residual=true is a variant our eagle3 head "
                         "cannot express (its residual is the un-normalized hidden)")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids") or \
        (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    bundle = HeadBundle(cfg_from_stamp(cfg.get("specheads_head"), "eagle3", draft_vocab_size=None,
                                       aux_layers=our_aux_ids(aux, str(path))),
                        arch_from_config(cfg, str(path)), cfg.get("specheads_target") or {}, {},
                        str(path))
    from_tensors(read_tensors(path), LAYER_PREFIX, bundle, NAME, cfg.get("draft_vocab_size"))
    return bundle
