"""Head checkpoints, the public entry (docs/export.md): save_head writes our
format, read_head_config and load_head read a head directory in any format we know.

Our format (config.json + model.safetensors with the trainable weights only, never pickle)
lives in heads/formats/specheads.py; vLLM/SGLang/EAGLE/DeepSeek-MTP directories are detected
by their config keys and imported through heads/formats/registry.py. The frozen embedding,
final norm and lm_head come from the target at load time.
"""
from __future__ import annotations

from pathlib import Path

from heads.base import DraftHead
from heads.formats import specheads
from heads.formats.bundle import read_json
from heads.formats.registry import foreign_head_config, import_head
from heads.frozen import FrozenParts


def save_head(head: DraftHead, path: str | Path, extra: dict | None = None) -> Path:
    """`head` -> a specheads checkpoint directory `path`; extra: more config.json keys."""
    return specheads.write(head, path, extra)


def read_head_config(path: str | Path) -> dict:
    """config.json of a head directory: ours as stored; for a foreign format {format, head:
    {type}, target} (what the file says of the target, {} if nothing)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no head checkpoint at {Path(path)} (config.json missing)")
    cfg = read_json(p)
    if specheads.detect(cfg):
        return cfg
    foreign = foreign_head_config(Path(path), cfg)
    if foreign is None:
        raise ValueError(f"{p} is neither a specheads head checkpoint (format "
                         f"{cfg.get('format')!r}) nor a draft head format train.export reads")
    return foreign


def load_head(path: str | Path, parts: FrozenParts, expect_type: str | None = None) -> DraftHead:
    """Rebuild a head on `parts` (the target's frozen tensors) and load its weights, from a
    directory in any format we read. expect_type: refuse a head of another head.type."""
    meta = read_head_config(path)
    if expect_type is not None and meta["head"]["type"] != expect_type:
        raise ValueError(f"checkpoint {path} holds a {meta['head']['type']!r} head, but head.type="
                         f"{expect_type!r} was asked for")
    if not specheads.detect(meta):
        return import_head(path, parts)
    return specheads.load(path, parts)
