"""The target's frozen embedding, final norm and lm_head, read without building the target.

Only three tensors are read (safetensors, sharded or not, or a GGUF via its cached
conversion), so a 70B target costs its ~2 GB of embedding/lm_head, not 140 GB. With a
sharded checkpoint, `model.safetensors.index.json` names the shards that hold them and only
those are opened; with a hub id only config.json, the index and those shards are downloaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.layers import RMSNorm
from inference_eval.engine.target import (TargetConfig, frozen_hash, load_target, resolve_path,
                                   target_hf_dir)

_NEEDED = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm",
           "lm_head.weight": "lm_head"}
INDEX = "model.safetensors.index.json"


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

    hub = _hub_id(cfg)
    hf_dir = _download_frozen(hub) if hub else target_hf_dir(cfg)
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(hf_dir))
    got = {}
    for fname in frozen_shards(hf_dir):
        path = hf_dir / fname
        if not path.is_file():
            raise FileNotFoundError(f"weight shard {path} listed in the index is missing")
        with safe_open(str(path), framework="pt") as f:
            for name in set(f.keys()) & set(_NEEDED):
                got[_NEEDED[name]] = f.get_tensor(name).to(cfg.torch_dtype)
    if arch.tie_word_embeddings:
        got["lm_head"] = got.get("embed")
    missing = [k for k in ("embed", "norm", "lm_head") if got.get(k) is None]
    if missing:
        raise ValueError(f"target checkpoint {hf_dir} lacks {missing}")
    # weights_sha256 needs the whole model; frozen_sha256 (the same on both sides) does not.
    identity = {"name": cfg.name, "source": cfg.source, "path": cfg.path, "arch": arch.to_dict(),
                "frozen_sha256": frozen_hash(got["embed"], got["norm"], got["lm_head"])}
    return FrozenParts(arch, got["embed"], got["norm"], got["lm_head"], identity)


def frozen_shards(hf_dir: Path) -> list[str]:
    """The safetensors files of hf_dir that hold the frozen tensors: from the index when the
    checkpoint is sharded, else every *.safetensors file (one, in practice)."""
    index = hf_dir / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({weight_map[n] for n in _NEEDED if n in weight_map})
    else:
        files = [p.name for p in sorted(hf_dir.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights for the embedding in {hf_dir}")
    return files


def _hub_id(cfg: TargetConfig) -> str | None:
    """cfg.path as a hub id when target_hf_dir would download it (same rule: not a local path,
    exactly one '/'), else None."""
    if cfg.source != "hf" or resolve_path(cfg.path).exists():
        return None
    spec = str(cfg.path)
    return spec if not spec.startswith((".", "/", "~", "pkg:")) and spec.count("/") == 1 else None


def _download_frozen(repo_id: str) -> Path:
    """config.json, the index and only the shards holding the frozen tensors (hub cache)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    hf_dir = Path(hf_hub_download(repo_id, "config.json")).parent
    try:
        hf_hub_download(repo_id, INDEX)
    except EntryNotFoundError:  # an unsharded checkpoint: its one file holds everything
        hf_hub_download(repo_id, "model.safetensors")
        return hf_dir
    for fname in frozen_shards(hf_dir):
        hf_hub_download(repo_id, fname)
    return hf_dir


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
