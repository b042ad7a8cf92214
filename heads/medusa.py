"""Medusa: K residual blocks on the target's last (post-norm) feature, no attention.

Head k (1-based) maps f_t to the token x_{t+k+1}, the same target position as step k of a
chain head, so one loss, one alignment and one `step` serve both: step k returns f_t itself
as its next hidden, so step k+1 reads the same base feature. A weaker baseline: no token
input (`uses_tokens = False`) and no attention (`attends = False`: ctx may be None).
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
    attends = False

    def __init__(self, cfg: HeadConfig, parts: FrozenParts,
                 draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__(cfg, parts, draft_vocab)
        h = self.arch.hidden_size
        self.blocks = nn.ModuleList(Linear(h, h, bias=True) for _ in range(cfg.num_steps))

    def init_parameter(self, name: str, p: nn.Parameter) -> None:
        if name.startswith("blocks."):  # start as identity: head k begins as the target's own guess
            p.zero_()
        else:
            super().init_parameter(name, p)

    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return self.frozen.norm(hidden)

    def step(self, tokens: torch.Tensor, hidden_in: torch.Tensor, ctx,
             k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Head k on the post-norm feature f = hidden_in [T, H] -> (f, f + silu(block_k(f))).
        tokens and ctx are not read (ctx may be None)."""
        if not 1 <= k <= len(self.blocks):
            raise ValueError(f"draft step k={k}: this Medusa head has {len(self.blocks)} heads "
                             f"(head.num_steps), steps 1..{len(self.blocks)}")
        return hidden_in, hidden_in + F.silu(self.blocks[k - 1](hidden_in))
