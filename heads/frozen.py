"""The target's frozen embedding, final norm and lm_head, read without building the target.

Only three tensors are read from the checkpoint (safetensors, sharded or not, or a GGUF via
its cached conversion), so a 70B target costs its ~2 GB of embedding/lm_head, not 140 GB.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inference_eval.model.arch import ModelArch
from inference_eval.model.layers import RMSNorm
from inference_eval.target import (TargetConfig, frozen_hash, iter_safetensors, load_target,
                                   target_hf_dir)

_NEEDED = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
           "lm_head.weight": "lm_head"}


@dataclass
class FrozenParts:
    """embed [V, H], norm_weight [H], lm_head [V, H] (the embedding itself when tied)."""

    arch: ModelArch
    embed: torch.Tensor
    norm_weight: torch.Tensor
    lm_head: torch.Tensor
    identity: dict


def load_frozen(cfg: TargetConfig) -> FrozenParts:
    if cfg.source == "random":  # test targets are tiny: build them whole
        loaded = load_target(cfg, with_tokenizer=False)
        m = loaded.model
        return FrozenParts(m.arch, m.embed_tokens.weight.detach(), m.norm.weight.detach(),
                           m.lm_head_weight.detach(), loaded.identity)
    from transformers import AutoConfig

    hf_dir = target_hf_dir(cfg)
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(hf_dir))
    got = {}
    for name, get in iter_safetensors(hf_dir):
        if name in _NEEDED:
            got[_NEEDED[name]] = get().to(cfg.torch_dtype)
    if arch.tie_word_embeddings:
        got["lm_head"] = got.get("embed")
    missing = [k for k in ("embed", "norm", "lm_head") if got.get(k) is None]
    if missing:
        raise ValueError(f"target checkpoint {hf_dir} lacks {missing}")
    # weights_sha256 needs the whole model; frozen_sha256 (the same on both sides) does not.
    identity = {"name": cfg.name, "source": cfg.source, "path": cfg.path, "arch": arch.to_dict(),
                "frozen_sha256": frozen_hash(got["embed"], got["norm"], got["lm_head"])}
    return FrozenParts(arch, got["embed"], got["norm"], got["lm_head"], identity)


class FrozenHead(nn.Module):
    """Final norm + lm_head of the target as non-trainable buffers (never saved by heads)."""

    def __init__(self, parts: FrozenParts) -> None:
        super().__init__()
        self.norm = RMSNorm(parts.arch.hidden_size, parts.arch.rms_norm_eps)
        self.norm.weight.requires_grad_(False)
        with torch.no_grad():
            self.norm.weight.copy_(parts.norm_weight)
        self.register_buffer("weight", parts.lm_head.detach(), persistent=False)

    def logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """hidden [N, H] (pre-norm unless normed) -> logits [N, V]."""
        x = hidden if normed else self.norm(hidden)
        return x @ self.weight.t().to(x.dtype)
