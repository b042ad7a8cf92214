"""The EAGLE-1 format (SafeAILab/EAGLE `cnets1.Model`, SGLang `LlamaForCausalLMEagle`).

    config.json        Llama config of one layer, "bias": true (the fc bias; EAGLE's loader
                       reads this key), architectures ["LlamaForCausalLMEagle"]
    model.safetensors  fc.weight [H, 2H], fc.bias [H]; layers.0.{self_attn.{q,k,v,o}_proj,
                       post_attention_layernorm, mlp.{gate,up,down}_proj} (layer 0 has no
                       input_layernorm: EAGLE feeds the fused [E(x); f] straight to attention)

The input feature is the target's post-final-norm state (HF `outputs[0]`), as in our eagle1
head; embedding and lm_head come from the target. vLLM's EagleLlamaForCausalLM builds fc
without a bias, so this format is for EAGLE itself and SGLang; importing a bias-free EAGLE-1
checkpoint gives our head a zero bias.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from heads.formats.bundle import (HeadBundle, arch_from_config, cfg_from_stamp, dtype_name,
                                 has_architecture, llama_layer_config,
                                 read_one_layer_config, read_tensors,
                                 refuse_unused, stamps, write_dir)
from heads.formats.layer_names import layer_from_hf, layer_to_hf

NAME = "eagle1"
HEAD_TYPES = ("eagle1",)
ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
LAYER_PREFIX = "layers.0."


def export(bundle: HeadBundle, out: Path, verifier: str | None = None) -> Path:
    a = bundle.arch
    if a.qkv_bias or a.qk_norm:
        raise ValueError(f"format {NAME!r} holds a Llama-layout layer without q/k/v bias or q/k "
                         f"norms, but this head's layer (target {a.architecture}) has "
                         f"{'q/k/v bias' if a.qkv_bias else 'q/k norms'}")
    s = bundle.state
    tensors = {"fc.weight": s["fc.weight"], "fc.bias": s["fc.bias"],
               **layer_to_hf(s, "layer.", LAYER_PREFIX, a)}
    config = llama_layer_config(a, architectures=["LlamaForCausalLMEagle"], bias=True,
                                torch_dtype=dtype_name(tensors),
                                **stamps(bundle, verifier))
    return write_dir(out, config, tensors)


def detect(cfg: dict[str, Any]) -> bool:
    return has_architecture(cfg, ARCHITECTURES)


def read(path: Path) -> HeadBundle:
    cfg = read_one_layer_config(path, "eagle1")
    src = str(path)
    arch = arch_from_config(cfg, src)
    t = read_tensors(path)
    if "fc.weight" not in t:
        raise ValueError(f"{src}: not an EAGLE-1 head (no fc.weight)")
    if f"{LAYER_PREFIX}input_layernorm.weight" in t:
        raise ValueError(f"{src}: layer 0 has an input_layernorm; our eagle1 head (like EAGLE's) "
                         "feeds the fused input to attention un-normalized")
    fc = t.pop("fc.weight")
    state = {"fc.weight": fc, "fc.bias": t.pop("fc.bias", torch.zeros(fc.shape[0], dtype=fc.dtype)),
             **layer_from_hf(t, LAYER_PREFIX, "layer.", arch, src)}
    embed = t.pop("embed_tokens.weight", None)
    refuse_unused(t, src, NAME)
    return HeadBundle(cfg_from_stamp(cfg.get("specheads_head"), "eagle1"), arch,
                      cfg.get("specheads_target") or {}, state, src, embed)
