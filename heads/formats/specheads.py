"""Our own head checkpoint format, `specheads-head-v1` (docs/export.md), and
building a head from trainable tensors in our parameter names.

    config.json        {"format": "specheads-head-v1", "head": HeadConfig fields,
                        "arch": the target's ModelArch, "target": its identity, ...extra}
    model.safetensors  the trainable weights only, by our parameter names (never pickle)

The frozen embedding, final norm and lm_head come from the target at load time. `to_head`
puts any format's HeadBundle on the target's parts the same way (`head_from_state`), so every
format ends in one strict load. The public entry points are heads.checkpoint's save_head,
read_head_config and load_head.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from heads.base import DraftHead
from heads.config import HeadConfig, eagle3_aux_layers
from heads.formats.bundle import (HeadBundle, check_compatible, read_config as read_config_json,
                                  read_safetensors)
from heads.frozen import FrozenParts
from heads.registry import build_head
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.rope import arch_rope_tables

NAME = "specheads"
FORMAT = "specheads-head-v1"


def detect(cfg: dict[str, Any]) -> bool:
    return cfg.get("format") == FORMAT


def write(head: DraftHead, path: str | Path, extra: dict | None = None) -> Path:
    """config.json + model.safetensors of `head` in `path`, each written to a temp name and
    renamed. extra: more config keys (e.g. where an imported head came from)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.trainable_state().items()}
    tmp = path / ".model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": FORMAT})
    os.replace(tmp, path / "model.safetensors")
    config = {"format": FORMAT, "head": asdict(head.cfg), "arch": head.arch.to_dict(),
              "target": head.target_identity, **(extra or {})}
    ctmp = path / ".config.json.tmp"
    ctmp.write_text(json.dumps(config, indent=1))
    os.replace(ctmp, path / "config.json")
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    """Our config.json as stored; a ValueError for a directory in another format."""
    cfg = read_config_json(Path(path))
    if not detect(cfg):
        raise ValueError(f"{Path(path) / 'config.json'} is not a specheads head checkpoint "
                         f"(format {cfg.get('format')!r})")
    return cfg


def read(path: str | Path) -> HeadBundle:
    """Our checkpoint directory -> bundle, without the target (what exporters read)."""
    meta = read_config(path)
    weights = Path(path) / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"head checkpoint {path} has no model.safetensors")
    return HeadBundle(HeadConfig.from_dict(meta["head"]), ModelArch(**meta["arch"]),
                      meta.get("target", {}), read_safetensors(weights), str(path))


def load(path: str | Path, parts: FrozenParts) -> DraftHead:
    """Our checkpoint directory -> head on `parts` (the target's frozen tensors)."""
    meta = read_config(path)
    t_arch = meta.get("arch", {})
    if t_arch.get("hidden_size") != parts.arch.hidden_size or \
            t_arch.get("vocab_size") != parts.arch.vocab_size:
        raise ValueError(f"head {path} was trained for a target with hidden_size "
                         f"{t_arch.get('hidden_size')} / vocab {t_arch.get('vocab_size')}, this "
                         f"target has {parts.arch.hidden_size} / {parts.arch.vocab_size}")
    return head_from_state(HeadConfig.from_dict(meta["head"]),
                           read_safetensors(Path(path) / "model.safetensors"), parts, str(path))


def head_from_state(cfg: HeadConfig, state: dict[str, torch.Tensor], parts: FrozenParts,
                    source: str) -> DraftHead:
    """Build a head on `parts` and load `state` (trainable tensors by our names): every
    trainable tensor must be there and nothing else, or the head would be half random."""
    head = build_head(cfg, parts, draft_vocab=state.get("d2t_ids"))
    try:
        _, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches: name the checkpoint, keep torch's detail
        raise ValueError(f"head checkpoint {source}: {exc}") from None
    lost = [k for k in head.trainable_state() if k not in state]
    if lost or unexpected:
        raise ValueError(f"head checkpoint {source}: missing {lost[:5]}, unexpected "
                         f"{list(unexpected)[:5]}")
    return head


def to_head(bundle: HeadBundle, parts: FrozenParts) -> DraftHead:
    """Put a bundle (any format, read without the target) on the target's frozen parts -> a
    DraftHead ready to evaluate or train."""
    check_compatible(bundle.arch, parts.arch, bundle.source,
                     ignore=("qk_norm",) if bundle.cfg.type == "dflash" else ())
    for what, mine, theirs in (("embed_tokens", bundle.embed, parts.embed),
                               ("lm_head", bundle.lm_head, parts.lm_head)):
        if mine is not None and not torch.equal(mine.to(theirs.dtype), theirs):
            raise ValueError(f"{bundle.source}: the checkpoint carries its own {what}, which "
                             f"differs from the target's; our heads use the target's frozen {what}")
    cfg = bundle.cfg
    if cfg.type == "eagle3" and not cfg.aux_layers:  # the engines' default = precompute's
        cfg = replace(cfg, aux_layers=eagle3_aux_layers(parts.arch.num_layers))
    bad = [i for i in cfg.aux_layers if not 0 <= i < parts.arch.num_layers]
    if bad:
        raise ValueError(f"{bundle.source}: auxiliary layers {bad} do not exist in a "
                         f"{parts.arch.num_layers}-layer target")
    head = head_from_state(cfg, bundle.state, parts, bundle.source)
    _adopt_rope(head, bundle.arch)
    return head


def _adopt_rope(head: DraftHead, arch: ModelArch) -> None:
    """Foreign heads are often served with their own rope (EAGLE-3 Llama-3.1 heads ship
    without the target's llama3 scaling); use what the engines use, so our numbers are theirs."""
    a = head.arch
    if (arch.rope_theta, arch.rope_scaling) == (a.rope_theta, a.rope_scaling):
        return
    adopted = replace(a, rope_theta=arch.rope_theta, rope_scaling=arch.rope_scaling)
    cos, sin = arch_rope_tables(adopted)
    head.rope_cos.copy_(cos[:head.rope_cos.shape[0]])
    head.rope_sin.copy_(sin[:head.rope_sin.shape[0]])
    head.arch = adopted
