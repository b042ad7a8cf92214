"""`load_conversations(cfg)`: the one call precompute makes to get validated chats."""

from __future__ import annotations

from .config import DataConfig
from .hf import load_hf
from .records import LoadResult
from .sharegpt import load_file, load_sharegpt


def load_conversations(cfg: DataConfig) -> LoadResult:
    """Dispatch on `cfg.source`; skip and limit apply to every source alike."""
    if cfg.source == "sharegpt":
        return load_sharegpt(cfg.path, skip=cfg.skip, limit=cfg.limit)
    if cfg.source == "jsonl":
        return load_file(cfg.path, skip=cfg.skip, limit=cfg.limit)
    if cfg.source == "hf":
        return load_hf(
            cfg.hf_name, config=cfg.hf_config, split=cfg.hf_split, skip=cfg.skip, limit=cfg.limit
        )
    raise ValueError(f"data.source {cfg.source!r} has no loader")  # DataConfig rules this out
