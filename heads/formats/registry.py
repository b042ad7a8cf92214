"""Which formats exist, which heads each can hold, and the one place that detects a head
directory's format from its config keys; reading any format into a HeadBundle, importing it
as a head and exporting to a foreign format. heads.checkpoint (save_head, read_head_config,
load_head) and the CLI (python -m train.export) dispatch through here; our own format lives
in heads/formats/specheads.py."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import heads.formats.deepseek_mtp as deepseek_mtp
import heads.formats.eagle1 as eagle1
import heads.formats.eagle3 as eagle3
import heads.formats.specheads as specheads
import heads.formats.speculators as speculators
from heads.base import DraftHead
from heads.formats.bundle import HeadBundle, read_config
from heads.frozen import FrozenParts

# Foreign formats only (ours, `specheads`, is detected first). Detection order matters: a
# speculators config is also an EAGLE-3 one in spirit, and only its speculators_model_type
# key tells them apart.
FORMATS: dict[str, ModuleType] = {"speculators": speculators, "eagle3": eagle3,
                                  "eagle1": eagle1, "deepseek_mtp": deepseek_mtp}


def formats_for(head_type: str) -> list[str]:
    return [name for name, fmt in FORMATS.items() if head_type in fmt.HEAD_TYPES]


def check_format(head_type: str, fmt: str) -> ModuleType:
    """The format module, or a ValueError naming the head type, the format and where the head
    type can go instead."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {sorted(FORMATS)}")
    module = FORMATS[fmt]
    if head_type not in module.HEAD_TYPES:
        others = formats_for(head_type)
        where = (f"a {head_type!r} head can be exported to {others}" if others else
                 f"no foreign format can express a {head_type!r} head; it stays in the specheads "
                 "format (evaluate it with python -m inference_eval)")
        raise ValueError(f"cannot export a {head_type!r} head to format {fmt!r}, which holds "
                         f"{list(module.HEAD_TYPES)} heads; {where}")
    return module


def export_head(checkpoint: str | Path, fmt: str, out: str | Path, *, verifier: str | None = None,
                target_dir: str | Path | None = None, copy: bool = False,
                dtype: torch.dtype | None = None) -> Path:
    """A head directory -> `out` in format `fmt` (see each format's module). The source is
    our checkpoint, or any format read_foreign knows (e.g. an SGLang EAGLE-3 head to vLLM's
    speculators format); the target itself is not needed.
    verifier: the name/path an engine loads as the target (default: the checkpoint's target).
    target_dir, copy: the target's HF directory to stitch into, and whether to copy its
    shards instead of symlinking them (deepseek_mtp only). dtype: of the written weights
    (default: the checkpoint's)."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.resolve() == checkpoint.resolve():
        raise ValueError(f"output {out} is the checkpoint itself; export to another directory")
    bundle = read_foreign(checkpoint)
    module = check_format(bundle.cfg.type, fmt)
    holds_bias = getattr(module, "holds_transition_bias", lambda cfg: False)
    if bundle.cfg.markov_rank and not holds_bias(bundle.cfg):
        raise ValueError(f"{checkpoint}: head.markov_rank={bundle.cfg.markov_rank} (the in-block "
                         f"transition bias) has no place in format {fmt!r}; a dflash head's goes "
                         "to format 'speculators' (as DSpark's Markov head), other heads' stay in "
                         "the specheads format (evaluate them with python -m inference_eval)")
    if dtype is not None:
        bundle.state = {k: v.to(dtype) if v.is_floating_point() else v
                        for k, v in bundle.state.items()}
    if module is deepseek_mtp:
        return module.export(bundle, out, target_dir=target_dir, copy=copy)
    return module.export(bundle, out, verifier=verifier)


def detect_format(path: str | Path, cfg: dict[str, Any] | None = None) -> str | None:
    """'specheads', a name in FORMATS, or None, from the directory's config.json keys."""
    cfg = read_config(Path(path)) if cfg is None else cfg
    if specheads.detect(cfg):
        return specheads.NAME
    return next((name for name, fmt in FORMATS.items() if fmt.detect(cfg)), None)


def read_foreign(path: str | Path, fmt: str | None = None) -> HeadBundle:
    """Any known head directory -> bundle (format detected unless given)."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    if fmt is None:
        raise ValueError(f"{path}: config.json matches none of the formats "
                         f"{['specheads', *FORMATS]} (no specheads format key, "
                         "speculators_model_type, EAGLE architecture or num_nextn_predict_layers)")
    return specheads.read(path) if fmt == specheads.NAME else FORMATS[fmt].read(path)


def import_head(path: str | Path, parts: FrozenParts, fmt: str | None = None) -> DraftHead:
    """A head directory in any known format -> our DraftHead on the target's frozen parts."""
    return specheads.to_head(read_foreign(path, fmt), parts)


def foreign_head_config(path: Path, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """What read_head_config reports for a foreign directory: format, head type and the target
    it names (if the file says); None when the format is unknown."""
    fmt = detect_format(path, cfg)
    if fmt is None or fmt == specheads.NAME:
        return None
    module = FORMATS[fmt]
    kind = module.head_type(cfg) if hasattr(module, "head_type") else module.HEAD_TYPES[0]
    return {"format": fmt, "head": {"type": kind}, "target": cfg.get("specheads_target") or {}}
