"""Head checkpoints (ARCHITECTURE: Head checkpoints): an HF-style directory with config.json
and model.safetensors holding the trainable weights only; loaded with safetensors, never
pickle. The frozen embedding, final norm and lm_head come from the target at load time."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from heads.base import DraftHead
from heads.config import HeadConfig
from heads.frozen import FrozenParts
from heads.registry import build_head

FORMAT = "specheads-head-v1"


def save_head(head: DraftHead, path: str | Path, extra: dict | None = None) -> Path:
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


def read_head_config(path: str | Path) -> dict:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no head checkpoint at {Path(path)} (config.json missing)")
    cfg = json.loads(p.read_text())
    if cfg.get("format") != FORMAT:
        # vLLM/SGLang/EAGLE/DeepSeek-MTP directories: detected by their config keys (lazy
        # import: the formats build on this module).
        from heads.formats import foreign_head_config

        foreign = foreign_head_config(Path(path), cfg)
        if foreign is None:
            raise ValueError(f"{p} is neither a specheads head checkpoint (format "
                             f"{cfg.get('format')!r}) nor a draft head format train.export reads")
        return foreign
    return cfg


def load_head(path: str | Path, parts: FrozenParts, expect_type: str | None = None) -> DraftHead:
    """Rebuild a head on `parts` (the target's frozen tensors) and load its weights."""
    from safetensors.torch import load_file

    meta = read_head_config(path)
    if expect_type is not None and meta["head"]["type"] != expect_type:
        raise ValueError(f"checkpoint {path} holds a {meta['head']['type']!r} head, but head.type="
                         f"{expect_type!r} was asked for")
    if meta["format"] != FORMAT:
        from heads.formats import import_head

        return import_head(path, parts)
    cfg = HeadConfig(**meta["head"])
    t_arch = meta.get("arch", {})
    if t_arch.get("hidden_size") != parts.arch.hidden_size or \
            t_arch.get("vocab_size") != parts.arch.vocab_size:
        raise ValueError(f"head {path} was trained for a target with hidden_size "
                         f"{t_arch.get('hidden_size')} / vocab {t_arch.get('vocab_size')}, this "
                         f"target has {parts.arch.hidden_size} / {parts.arch.vocab_size}")
    return head_from_state(cfg, load_file(str(Path(path) / "model.safetensors")), parts, str(path))


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
