"""The original EAGLE head, kept as the baseline the MTP norms are measured against.

    z = fc([E[x_{t+1}]; f_t])   f_t = final_norm(hidden_t) (post-norm feature), 2H -> H, bias
    o = DecoderLayer without input norm (z)
    logits = lm_head(o)          no final norm; o feeds step k+1
"""
from __future__ import annotations

import torch

from heads.base import DraftHead
from heads.config import HeadConfig
from heads.frozen import FrozenParts
from inference_eval.engine.model.layers import DecoderLayer
from inference_eval.engine.model.linear import Linear


class Eagle1Head(DraftHead):
    def __init__(self, cfg: HeadConfig, parts: FrozenParts,
                 draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__(cfg, parts, draft_vocab)
        h = self.arch.hidden_size
        self.fc = Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(self.arch, 0, input_norm=False)

    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return self.frozen.norm(hidden)

    def feature_target(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.frozen.norm(hidden)

    def step(self, tokens: torch.Tensor, hidden_in: torch.Tensor, ctx,
             k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer serves every draft step, so k is not read."""
        o = self.layer(self.fc(torch.cat([self.embed_tokens(tokens), hidden_in], -1)), ctx)
        return o, o
