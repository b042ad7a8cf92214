"""Build a head from its config and the target's frozen parts."""
from __future__ import annotations

import torch

from heads.base import DraftHead
from heads.config import HeadConfig
from heads.eagle1 import Eagle1Head
from heads.eagle3 import Eagle3Head
from heads.frozen import FrozenParts
from heads.medusa import MedusaHead
from heads.mtp import MTPHead

HEADS = {"mtp": MTPHead, "eagle1": Eagle1Head, "eagle3": Eagle3Head, "medusa": MedusaHead}


def build_head(cfg: HeadConfig, parts: FrozenParts, draft_vocab: torch.Tensor | None = None,
               seed: int = 0) -> DraftHead:
    """Trainable weights are initialized from `seed` (normal std 0.02, norms at 1)."""
    torch.manual_seed(seed)
    if cfg.type == "eagle3":
        head = Eagle3Head(cfg, parts, draft_vocab)
    else:
        head = HEADS[cfg.type](cfg, parts)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not p.requires_grad or name == "draft_lm_head" or name.startswith("blocks."):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return head
