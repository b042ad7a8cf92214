"""speculators' block drafters (the format vLLM loads): DFlash and P-EAGLE directories.

    dflash   config.json   speculators_model_type "dflash", block_size B (= our num_steps + 1),
                           mask_token_id, aux_hidden_state_layer_ids (HF hidden_states ids:
                           ours + 1, as EAGLE-3's), sample_from_anchor false (the anchor is the
                           last verified token, rows 1..B-1 are the drafts),
                           transformer_layer_config: a Qwen3 config of num_layers layers (the
                           q/k-normed layer speculators builds whatever the target)
             tensors       fc.weight [H, A*H], hidden_norm.weight, norm.weight (our
                           final_norm), layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
                           self_attn.{q,k}_norm, post_attention_layernorm, mlp.*};
                           reduced vocabulary: lm_head.weight (the target's rows: DFlash keeps
                           them frozen; read, not written: an export has no target), d2t
                           offsets, t2d
    peagle   config.json   EAGLE-3's (speculators.py) with speculators_model_type "peagle" and
                           mask_token_id
             tensors       EAGLE-3's, and mask_hidden [1, 1, A*H]

The embedding and full-vocabulary lm_head are the verifier's (speculators loads them itself).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import heads.formats.eagle3 as eagle3
from heads.config import mask_token
from heads.formats.bundle import (HeadBundle, arch_from_config, cfg_from_stamp, dtype_name,
                                  llama_layer_config, read_config, read_tensors, refuse_unused,
                                  stamps, write_dir)
from heads.formats.layer_names import layer_from_hf, layer_to_hf

SPECULATORS_VERSION = "0.9.0"


def _spec_config(algorithm: str, tokens: int, verifier: str | None, arch) -> dict[str, Any]:
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [arch.architecture]}}


# ---- DFlash -------------------------------------------------------------------------------
def export_dflash(bundle: HeadBundle, out: Path, verifier: str | None) -> Path:
    a, cfg = bundle.arch, bundle.cfg
    if a.qkv_bias:
        raise ValueError("format 'speculators' (dflash) holds a layer without q/k/v bias, but "
                         f"this head's layers (target {a.architecture}) have one")
    if cfg.draft_vocab_size is not None:
        # speculators stores a reduced vocabulary's lm_head rows, which are the target's (frozen
        # in both); a checkpoint does not hold them and an export does not load the target.
        raise ValueError("format 'speculators' (dflash): a reduced-vocabulary head's lm_head rows "
                         "are the target's, which the export does not load; train the dflash "
                         "head with head.draft_vocab_size=null to export it")
    s = dict(bundle.state)
    tensors = {"fc.weight": s.pop("fc.weight"), "hidden_norm.weight": s.pop("hidden_norm.weight"),
               "norm.weight": s.pop("final_norm.weight")}
    for i in range(cfg.num_layers):
        tensors.update(layer_to_hf(s, f"layers.{i}.", f"layers.{i}.", a))
    for k in [k for k in s if k.startswith("layers.")]:
        s.pop(k)
    vocab = a.vocab_size
    assert not s, f"dflash tensors without a speculators name: {sorted(s)}"
    layer = llama_layer_config(a, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                               num_hidden_layers=cfg.num_layers, torch_dtype=dtype_name(tensors),
                               tie_word_embeddings=False)
    config = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": _spec_config("dflash", cfg.num_steps, verifier, a),
        "transformer_layer_config": layer, "draft_vocab_size": vocab,
        "block_size": cfg.num_steps + 1, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": eagle3.engine_aux_ids(bundle),
        "mask_token_id": mask_token(cfg, a.vocab_size), "sliding_window_non_causal": False,
        "sample_from_anchor": False, "torch_dtype": dtype_name(tensors),
        **stamps(bundle, verifier)}
    return write_dir(out, config, tensors)


def read_dflash(path: Path, cfg: dict[str, Any]) -> HeadBundle:
    src = str(path)
    if cfg.get("sample_from_anchor"):
        raise ValueError(f"{src}: sample_from_anchor=true (DSpark's variant: the anchor row "
                         "drafts too); our dflash head drafts from the mask rows only")
    layer = dict(cfg.get("transformer_layer_config") or {})
    if any(t == "sliding_attention" for t in layer.get("layer_types") or []):
        raise ValueError(f"{src}: sliding-window draft layers; our dflash layers attend fully")
    n_layers = int(layer.get("num_hidden_layers", 1))
    arch = replace(arch_from_config(layer, src), qk_norm=True)
    if cfg.get("target_hidden_size") not in (None, arch.hidden_size):
        raise ValueError(f"{src}: target_hidden_size={cfg['target_hidden_size']} differs from the "
                         f"draft's {arch.hidden_size}; our heads share the target's width")
    block = int(cfg.get("block_size") or 8)
    aux = eagle3.our_aux_ids(cfg.get("aux_hidden_state_layer_ids"), src)
    if not aux:
        raise ValueError(f"{src}: no aux_hidden_state_layer_ids; a dflash head needs them")
    head_cfg = cfg_from_stamp(cfg.get("specheads_head"), "dflash", num_steps=block - 1,
                              num_layers=n_layers, aux_layers=aux, draft_vocab_size=None,
                              mask_token_id=cfg.get("mask_token_id"))
    t = read_tensors(path)
    state = {}
    for ours, theirs in (("fc.weight", "fc.weight"), ("hidden_norm.weight", "hidden_norm.weight"),
                         ("final_norm.weight", "norm.weight")):
        if theirs not in t:
            raise ValueError(f"{src}: not a DFlash head, {theirs} missing")
        state[ours] = t.pop(theirs)
    for i in range(n_layers):
        state.update(layer_from_hf(t, f"layers.{i}.", f"layers.{i}.", arch, src))
    lm_head, d2t = t.pop("lm_head.weight", None), t.pop("d2t", None)
    t.pop("t2d", None)
    t.pop("embed_tokens.weight", None)  # the verifier's, when a checkpoint carries it
    refuse_unused(t, src, "speculators")
    bundle = HeadBundle(head_cfg, arch, cfg.get("specheads_target") or {}, state, src)
    if lm_head is not None and lm_head.shape[0] != arch.vocab_size:
        # A reduced vocabulary: speculators keeps its rows frozen at the verifier's, which
        # our head gathers from the target itself; only the ids are read.
        if d2t is None or d2t.numel() != lm_head.shape[0]:
            raise ValueError(f"{src}: lm_head has {lm_head.shape[0]} rows but no d2t map of "
                             "that length")
        state["d2t_ids"] = d2t.long() + torch.arange(d2t.numel())
        bundle.cfg = replace(head_cfg, draft_vocab_size=d2t.numel())
    elif lm_head is not None:
        bundle.lm_head = lm_head
    return bundle


# ---- P-EAGLE ------------------------------------------------------------------------------
def export_peagle(bundle: HeadBundle, out: Path, verifier: str | None, export_eagle3) -> Path:
    """export_eagle3: speculators.export, which writes the EAGLE-3 part."""
    state = dict(bundle.state)
    mask_hidden = state.pop("mask_hidden")
    out = export_eagle3(replace(bundle, state=state), out, verifier)
    config = read_config(out)
    config.update({"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
                   "mask_token_id": mask_token(bundle.cfg, bundle.arch.vocab_size)})
    config["speculators_config"]["algorithm"] = "peagle"
    tensors = read_tensors(out)
    tensors["mask_hidden"] = mask_hidden.reshape(1, 1, -1).to(tensors["fc.weight"].dtype)
    return write_dir(out, config, tensors)
