"""The `speculators` format vLLM loads (`--speculative-config '{"model": DIR}'`): EAGLE-3 heads,
and the block drafters DFlash and P-EAGLE (speculators_block.py).

    config.json        speculators_model_type "eagle3", speculators_config {algorithm,
                       proposal_methods [greedy, speculative_tokens = our num_steps],
                       verifier {name_or_path, architectures}}, transformer_layer_config
                       (a LlamaConfig of head.num_layers layers), draft_vocab_size (V when
                       full), norm_before_residual false, eagle_aux_hidden_state_layer_ids
    model.safetensors  EAGLE-3 tensors (see eagle3.py) with the first layer under `layers.0.`
                       and a multi-layer head's plain layers under `layers.{i}.`

vLLM fills a missing norm_before_residual with TRUE, so it is always written. Heads other
than eagle3 have no speculators type vLLM serves with our layout (its `mtp` type is the
FastMTP Qwen3 layer, which feeds normed states between steps), so they are refused.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import heads.formats.eagle3 as eagle3
import heads.formats.speculators_block as block
from heads.formats.bundle import (HeadBundle, arch_from_config, cfg_from_stamp, dtype_name,
                                 head_stamp, llama_layer_config, read_config, read_tensors,
                                 refuse_sliding_window,
                                 target_stamp, write_dir)

NAME = "speculators"
HEAD_TYPES = ("eagle3", "dflash")
LAYER_PREFIX = "layers.0."
# The speculators release whose Eagle3DraftModel the real-client test loads our export with.
SPECULATORS_VERSION = "0.9.0"
# Variants of the speculators EAGLE-3 model our head has no parts for.
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def default_verifier(bundle: HeadBundle) -> str | None:
    """What vLLM should load as the target: the HF directory/hub id for hf targets, else the
    name (a GGUF or random target has no HF path an engine could load)."""
    t = bundle.target
    return t.get("path") if t.get("source") == "hf" else t.get("name")


def holds_transition_bias(cfg) -> bool:
    """Whether a head's in-block transition bias has a place here: a dflash head's, as
    DSpark's Markov head (export_dflash checks it biases d_1 as DSpark does)."""
    return cfg.type == "dflash"


def export(bundle: HeadBundle, out: Path, verifier: str | None = None) -> Path:
    """eagle3 -> "eagle3" (or "peagle" with head.parallel_drafting), dflash -> "dflash" (or
    "dspark" with the transition bias or the confidence head)."""
    verifier = verifier or default_verifier(bundle)
    if bundle.cfg.type == "dflash":
        return block.export_dflash(bundle, out, verifier)
    if bundle.cfg.parallel_drafting:
        return block.export_peagle(bundle, out, verifier, _export_eagle3)
    return _export_eagle3(bundle, out, verifier)


def _export_eagle3(bundle: HeadBundle, out: Path, verifier: str | None) -> Path:
    eagle3.check_expressible(bundle, NAME)
    tensors = eagle3.to_tensors(bundle, LAYER_PREFIX)
    a = bundle.arch
    verifier = verifier or default_verifier(bundle)
    aux = eagle3.engine_aux_ids(bundle)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": bundle.cfg.num_steps,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [a.architecture]},
        },
        "transformer_layer_config": llama_layer_config(
            a, torch_dtype=dtype_name(tensors), tie_word_embeddings=False,
            num_hidden_layers=bundle.cfg.num_layers),
        "draft_vocab_size": tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors
        else a.vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": aux,
        "torch_dtype": dtype_name(tensors),
        "specheads_target": {**target_stamp(bundle), "verifier": verifier},
        "specheads_head": head_stamp(bundle.cfg),
    }
    return write_dir(out, config, tensors)


def detect(cfg: dict[str, Any]) -> bool:
    return "speculators_model_type" in cfg


def head_type(cfg: dict[str, Any]) -> str:
    """Our head type of a speculators config."""
    return "dflash" if cfg.get("speculators_model_type") in ("dflash", "dspark") else "eagle3"


def read(path: Path) -> HeadBundle:
    cfg = read_config(path)
    src = str(path)
    kind = cfg.get("speculators_model_type")
    if kind in ("dflash", "dspark"):
        return block.read_dflash(path, cfg)
    if kind not in ("eagle3", "peagle"):
        raise ValueError(f"{src}: speculators model type {kind!r}; 'eagle3', 'peagle', 'dflash' "
                         "and 'dspark' map onto our heads (head.type=eagle3, eagle3 with "
                         "head.parallel_drafting, dflash, dflash with head.markov_rank / "
                         "head.confidence_head)")
    on = [f for f in _UNSUPPORTED_FLAGS if cfg.get(f)]
    if on:
        raise ValueError(f"{src}: {on} set; our eagle3 head has no such variant")
    layer = cfg.get("transformer_layer_config") or {}
    refuse_sliding_window(layer, src, "eagle3")
    arch = arch_from_config(layer, src)
    if cfg.get("target_hidden_size") not in (None, arch.hidden_size):
        raise ValueError(f"{src}: target_hidden_size={cfg['target_hidden_size']} differs from the "
                         f"draft's {arch.hidden_size}; our heads share the target's width")
    spec = cfg.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    steps = methods[0].get("speculative_tokens") or 1
    bundle = HeadBundle(
        cfg_from_stamp(cfg.get("specheads_head"), "eagle3", num_steps=steps, draft_vocab_size=None,
                       num_layers=int(layer.get("num_hidden_layers", 1)),
                       aux_layers=eagle3.our_aux_ids(cfg.get("eagle_aux_hidden_state_layer_ids"),
                                                     src)),
        arch, cfg.get("specheads_target") or {"name": verifier, "path": verifier}, {}, src)
    tensors = read_tensors(path)
    if kind == "peagle":  # EAGLE-3 plus the mask hidden state its steps 2..K read
        mask_hidden = tensors.pop("mask_hidden", None)
        if mask_hidden is None:
            raise ValueError(f"{src}: a peagle head without mask_hidden")
    eagle3.from_tensors(tensors, LAYER_PREFIX, bundle, NAME, cfg.get("draft_vocab_size"))
    if kind == "peagle":
        bundle.state["mask_hidden"] = mask_hidden.reshape(-1)
        bundle.cfg = replace(bundle.cfg, parallel_drafting=True,
                             mask_token_id=cfg.get("mask_token_id"))
    return bundle
