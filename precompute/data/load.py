"""`load_conversations(cfg)`: the one call precompute makes to get validated chats;
`load_prompts(cfg)`: the one call self-distillation makes to get the prompts it answers."""

from __future__ import annotations

from .config import DataConfig
from .hf import load_hf
from .mix import load_mix
from .records import LoadResult
from .sharegpt import load_file, load_sharegpt


def load_conversations(cfg: DataConfig, *, prompts: bool = False) -> LoadResult:
    """Dispatch on `cfg.source`; skip and limit apply to every source alike.

    prompts: read prompt records instead of chats (see `load_prompts`)."""
    if cfg.source == "sharegpt":
        return load_sharegpt(cfg.path, skip=cfg.skip, limit=cfg.limit, prompts=prompts)
    if cfg.source == "jsonl":
        return load_file(cfg.path, skip=cfg.skip, limit=cfg.limit, prompts=prompts)
    if cfg.source == "mix":
        if not prompts:
            raise ValueError("data=mix holds prompts only: have the target answer them first "
                             "(python -m precompute.distill data=mix ..., or data.regenerate=true)")
        return load_mix(cfg.limit, cfg.code_share, skip=cfg.skip)
    if cfg.source == "hf":
        return load_hf(
            cfg.hf_name, config=cfg.hf_config, split=cfg.hf_split, skip=cfg.skip, limit=cfg.limit,
            prompts=prompts,
        )
    raise ValueError(f"data.source {cfg.source!r} has no loader")  # DataConfig rules this out


def load_prompts(cfg: DataConfig) -> LoadResult:
    """The prompts self-distillation answers: `{"prompt"}` records, or the user turns of chat
    records (assistant turns ignored), as Conversations of user turns only; a repeated id is
    rejected ("duplicate_id"). Same sources, skip and limit as `load_conversations`."""
    return load_conversations(cfg, prompts=True)
