"""The RMSNorm-augmented MTP head (DeepSeek-V3 layout; the default).

    e = enorm(E[x_{t+1}]); h = hnorm(hidden_t); z = eh_proj([e; h])   (2H -> H)
    o = DecoderLayer(z)            (full layer, its own input and post-attention norms)
    logits = lm_head(final_norm(o))  (frozen lm_head of the target), o feeds step k+1

The two input norms put the embedding and the hidden state on one scale before the
projection, and the final norm lets the layer emit into the space the frozen lm_head was
trained on; without them MTP heads of 70B targets trained on long prompts did not converge, and
with them their accuracy rose a few points (the EAGLE layout drops these norms).
"""
from __future__ import annotations

import torch

from heads.base import DraftHead
from heads.config import HeadConfig
from heads.frozen import FrozenParts
from inference_eval.engine.model.layers import DecoderLayer, RMSNorm
from inference_eval.engine.model.linear import Linear


class MTPHead(DraftHead):
    def __init__(self, cfg: HeadConfig, parts: FrozenParts,
                 draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__(cfg, parts, draft_vocab)
        a, h = self.arch, self.arch.hidden_size
        self.enorm = RMSNorm(h, a.rms_norm_eps)
        self.hnorm = RMSNorm(h, a.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(a, 0)
        self.final_norm = RMSNorm(h, a.rms_norm_eps)

    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """hidden [T, H] pre-norm -> itself, or final_norm(hidden) for hidden_input=post_norm
        (a native DeepSeek MTP layer: its hnorm was trained on the normed state)."""
        if self.cfg.hidden_input == "post_norm":
            return self.frozen.norm(hidden)
        return hidden

    def step(self, tokens: torch.Tensor, hidden_in: torch.Tensor, ctx,
             k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer serves every draft step, so k is not read."""
        h = self.hnorm(hidden_in)
        if self.training and self.cfg.hidden_noise > 0:
            h = h + torch.randn_like(h) * self.cfg.hidden_noise
        z = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(tokens)), h], -1))
        o = self.layer(z, ctx)
        return o, self.final_norm(o)
