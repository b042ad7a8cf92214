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
                           reduced vocabulary: lm_head.weight (the target's rows, which DFlash
                           keeps frozen: an export reads them from the checkpoint's target),
                           d2t offsets, t2d
    dspark   a dflash directory with speculators_model_type "dspark": a head with the transition
                           bias (head.markov_rank, which must bias d_1 from the anchor as DSpark
                           does: head.markov_first) or the confidence head; markov_rank,
                           markov_head_type "vanilla", enable_confidence_head,
                           confidence_head_with_markov (when both are there)
             tensors       the dflash ones and markov_head.markov_w1.weight [V, r] (our U),
                           markov_head.markov_w2.weight [V_draft, r] (our W),
                           confidence_head.proj.{weight [1, H + r], bias [1]}
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
                                  llama_layer_config, read_config, read_tensors,
                                  refuse_sliding_window, refuse_unused, stamps, write_dir)
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
    spark = bool(cfg.markov_rank) or cfg.confidence_head
    if cfg.markov_rank and not cfg.markov_first:
        raise ValueError("format 'speculators' (dspark): DSpark's Markov head biases d_1 too, from "
                         "the block's anchor, and this head's bias starts at d_2; train the dflash "
                         "head with head.markov_first=true to export it")
    s = dict(bundle.state)
    tensors = {"fc.weight": s.pop("fc.weight"), "hidden_norm.weight": s.pop("hidden_norm.weight"),
               "norm.weight": s.pop("final_norm.weight")}
    if cfg.draft_vocab_size is not None:  # the target's frozen rows, and the maps
        ids = s.pop("d2t_ids").long()
        tensors.update(eagle3.vocab_maps(ids, a.vocab_size))
        tensors["lm_head.weight"] = _target_rows(bundle, ids).to(tensors["fc.weight"].dtype)
    if cfg.markov_rank:
        tensors["markov_head.markov_w1.weight"] = s.pop("transition.prev")
        tensors["markov_head.markov_w2.weight"] = s.pop("transition.out")
    if cfg.confidence_head:
        tensors["confidence_head.proj.weight"] = s.pop("confidence.weight")
        tensors["confidence_head.proj.bias"] = s.pop("confidence.bias")
    for i in range(cfg.num_layers):
        tensors.update(layer_to_hf(s, f"layers.{i}.", f"layers.{i}.", a))
    for k in [k for k in s if k.startswith("layers.")]:
        s.pop(k)
    vocab = a.vocab_size
    assert not s, f"dflash tensors without a speculators name: {sorted(s)}"
    layer = llama_layer_config(a, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                               num_hidden_layers=cfg.num_layers, torch_dtype=dtype_name(tensors),
                               tie_word_embeddings=False)
    kind = "dspark" if spark else "dflash"
    config = {
        "architectures": ["DSparkSpeculator" if spark else "DFlashSpeculator"],
        "speculators_model_type": kind, "speculators_version": SPECULATORS_VERSION,
        "speculators_config": _spec_config(kind, cfg.num_steps, verifier, a),
        "transformer_layer_config": layer,
        "draft_vocab_size": vocab if cfg.draft_vocab_size is None else cfg.draft_vocab_size,
        "block_size": cfg.num_steps + 1, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": eagle3.engine_aux_ids(bundle),
        "mask_token_id": mask_token(cfg, a.vocab_size), "sliding_window_non_causal": False,
        "sample_from_anchor": False, "torch_dtype": dtype_name(tensors),
        **stamps(bundle, verifier)}
    if spark:
        config.update({"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
                       "enable_confidence_head": cfg.confidence_head,
                       "confidence_head_with_markov": cfg.confidence_head and bool(cfg.markov_rank)})
    return write_dir(out, config, tensors)


def _target_rows(bundle: HeadBundle, ids: torch.Tensor) -> torch.Tensor:
    """The target lm_head's rows [V_draft, H] of a reduced vocabulary, read from the target the
    checkpoint names (only its embedding / lm_head tensors are opened, heads/frozen.py)."""
    from heads.frozen import load_frozen
    from inference_eval.engine.target import TargetConfig

    t = bundle.target
    if not t.get("source") or (t["source"] != "random" and not t.get("path")):
        raise ValueError(f"{bundle.source}: a reduced-vocabulary dflash head exports the target's "
                         "lm_head rows, but the checkpoint names no target to read them from")
    parts = load_frozen(TargetConfig(name=t.get("name") or "target", source=t["source"],
                                     path=t.get("path"), arch=t.get("arch") or {},
                                     seed=t.get("seed", 0)))
    want = t.get("frozen_sha256")
    if want and parts.identity.get("frozen_sha256") != want:
        raise ValueError(f"{bundle.source}: the target at {t.get('path')} is not the one the head "
                         "was trained on (its embedding / lm_head hash differs)")
    return parts.lm_head[ids]


def read_dflash(path: Path, cfg: dict[str, Any]) -> HeadBundle:
    src = str(path)
    # speculators' default: false for dflash, true for dspark (DeepSeek's convention)
    if cfg.get("sample_from_anchor", cfg.get("speculators_model_type") == "dspark"):
        raise ValueError(f"{src}: sample_from_anchor=true (DSpark's variant: the anchor row "
                         "drafts too); our dflash head drafts from the mask rows only")
    layer = dict(cfg.get("transformer_layer_config") or {})
    refuse_sliding_window(layer, src, "dflash")
    n_layers = int(layer.get("num_hidden_layers", 1))
    arch = replace(arch_from_config(layer, src), qk_norm=True)
    if cfg.get("target_hidden_size") not in (None, arch.hidden_size):
        raise ValueError(f"{src}: target_hidden_size={cfg['target_hidden_size']} differs from the "
                         f"draft's {arch.hidden_size}; our heads share the target's width")
    block = int(cfg.get("block_size") or 8)
    aux = eagle3.our_aux_ids(cfg.get("aux_hidden_state_layer_ids"), src)
    if not aux:
        raise ValueError(f"{src}: no aux_hidden_state_layer_ids; a dflash head needs them")
    spark = _spark_config(cfg, src)
    head_cfg = cfg_from_stamp(cfg.get("specheads_head"), "dflash", num_steps=block - 1,
                              num_layers=n_layers, aux_layers=aux, draft_vocab_size=None,
                              mask_token_id=cfg.get("mask_token_id"), **spark)
    t = read_tensors(path)
    state = {}
    for ours, theirs in (("fc.weight", "fc.weight"), ("hidden_norm.weight", "hidden_norm.weight"),
                         ("final_norm.weight", "norm.weight")):
        if theirs not in t:
            raise ValueError(f"{src}: not a DFlash head, {theirs} missing")
        state[ours] = t.pop(theirs)
    for i in range(n_layers):
        state.update(layer_from_hf(t, f"layers.{i}.", f"layers.{i}.", arch, src))
    for ours, theirs, wanted in (
            ("transition.prev", "markov_head.markov_w1.weight", spark["markov_rank"]),
            ("transition.out", "markov_head.markov_w2.weight", spark["markov_rank"]),
            ("confidence.weight", "confidence_head.proj.weight", spark["confidence_head"]),
            ("confidence.bias", "confidence_head.proj.bias", spark["confidence_head"])):
        if wanted:
            if theirs not in t:
                raise ValueError(f"{src}: its config asks for {theirs}, which it lacks")
            state[ours] = t.pop(theirs)
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


def _spark_config(cfg: dict[str, Any], src: str) -> dict[str, Any]:
    """Our head keys of a dspark config (none for dflash): its Markov head is our transition
    bias with d_1 biased from the anchor (markov_first), its confidence head ours."""
    if cfg.get("speculators_model_type") != "dspark":
        return {"markov_rank": 0, "markov_first": False, "confidence_head": False}
    rank = int(cfg.get("markov_rank", 256))
    if rank and cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(f"{src}: markov_head_type={cfg['markov_head_type']!r}; our transition "
                         "bias is DSpark's 'vanilla' (first-order) Markov head")
    conf = bool(cfg.get("enable_confidence_head", True))
    if conf and rank and not cfg.get("confidence_head_with_markov", True):
        raise ValueError(f"{src}: a confidence head that does not read the Markov embedding; "
                         "ours reads it whenever the head has one")
    return {"markov_rank": rank, "markov_first": bool(rank), "confidence_head": conf}


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
