"""Medusa: K residual blocks on the target's last (post-norm) feature, no attention.

Head k (1-based) maps f_t to the token x_{t+k+1}, the same target position as step k of a
chain head, so one loss and one alignment serve both. A weaker baseline: no token input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead
from heads.config import HeadConfig
from heads.frozen import FrozenParts
from inference_eval.engine.model.linear import Linear


class MedusaHead(DraftHead):
    uses_tokens = False

    def __init__(self, cfg: HeadConfig, parts: FrozenParts) -> None:
        super().__init__(cfg, parts)
        h = self.arch.hidden_size
        self.blocks = nn.ModuleList(Linear(h, h, bias=True) for _ in range(cfg.num_steps))
        for b in self.blocks:  # start as identity: head k begins as the target's own guess
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return self.frozen.norm(hidden)

    def medusa_step(self, k: int, feature: torch.Tensor) -> torch.Tensor:
        """features of head k (1-based) from the post-norm target feature [T, H]."""
        return feature + F.silu(self.blocks[k - 1](feature))
