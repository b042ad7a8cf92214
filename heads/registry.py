"""Build a head from its config and the target's frozen parts: the head classes by type, and
the seeded weight init each head defines for itself (`DraftHead.init_weights`)."""
from __future__ import annotations

import torch

from heads.base import DraftHead
from heads.config import HeadConfig
from heads.dflash import DFlashHead
from heads.eagle1 import Eagle1Head
from heads.eagle3 import Eagle3Head
from heads.frozen import FrozenParts
from heads.medusa import MedusaHead
from heads.mtp import MTPHead

HEADS = {"mtp": MTPHead, "eagle1": Eagle1Head, "eagle3": Eagle3Head, "medusa": MedusaHead,
         "dflash": DFlashHead}


def build_head(cfg: HeadConfig, parts: FrozenParts, draft_vocab: torch.Tensor | None = None,
               seed: int = 0) -> DraftHead:
    """Trainable weights are initialized from `seed` by the head's own init_weights (normal
    std 0.02, norms at 1, biases at 0 unless the head says otherwise). draft_vocab: the t2d
    ids of a reduced vocabulary [V_draft] (heads.vocab), with cfg.draft_vocab_size."""
    torch.manual_seed(seed)
    head = HEADS[cfg.type](cfg, parts, draft_vocab)
    head.init_weights()
    return head
