"""EAGLE-3: fused auxiliary target layers, a 2H-wide attention input, optional reduced vocab.

    step 1: g_t = fc([a1_t; a2_t; a3_t])   (A*H -> H) from the target's auxiliary layers
    later : g = the previous step's output
    x = [input_norm(E[x_{t+1}]); hidden_norm(g)]  (2H) -> attention; residual = g
    o = g + attn(x); o = o + mlp(post_norm(o));   logits = lm_head(final_norm(o))

With draft_vocab_size set, the head has its own lm_head over the V_draft most frequent
loss-masked target tokens (t2d: target ids kept; d2t: draft id -> target id).
"""
from __future__ import annotations

import torch
from torch import nn

from heads.base import DraftHead
from heads.config import HeadConfig
from heads.frozen import FrozenParts
from inference_eval.engine.model.layers import DecoderLayer, RMSNorm
from inference_eval.engine.model.linear import Linear


class Eagle3Head(DraftHead):
    def __init__(self, cfg: HeadConfig, parts: FrozenParts, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__(cfg, parts)
        a, h = self.arch, self.arch.hidden_size
        n_aux = max(len(cfg.aux_layers), 1)
        if not cfg.aux_layers:
            raise ValueError("head.type=eagle3 needs shards with auxiliary layers: precompute "
                             "with aux=eagle3 (head.aux_layers is read from the manifest)")
        self.fc = Linear(n_aux * h, h, bias=False)
        self.input_norm = RMSNorm(h, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, a.rms_norm_eps)
        self.layer = DecoderLayer(a, 0, input_norm=False, attn_in_features=2 * h)
        self.final_norm = RMSNorm(h, a.rms_norm_eps)
        self.draft_lm_head = None
        if cfg.draft_vocab_size is not None:
            if draft_vocab is None or draft_vocab.numel() != cfg.draft_vocab_size:
                raise ValueError("a reduced EAGLE-3 vocabulary needs its token list (t2d ids)")
            self.register_buffer("d2t_ids", draft_vocab.long(), persistent=True)
            self.draft_lm_head = nn.Parameter(parts.lm_head[draft_vocab.long()].clone())

    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        if aux is None:
            raise ValueError("EAGLE-3 needs aux_hidden in the shards (precompute aux=eagle3)")
        return self.fc(aux.reshape(aux.shape[0], -1))

    def step(self, tokens: torch.Tensor, hidden_in: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_norm(self.embed_tokens(tokens)), self.hidden_norm(hidden_in)], -1)
        o = self.layer(x, ctx, residual=hidden_in)
        return o, self.final_norm(o)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.frozen.weight if self.draft_lm_head is None else self.draft_lm_head

    def draft_to_target(self) -> torch.Tensor | None:
        return None if self.draft_lm_head is None else self.d2t_ids

    def trainable_state(self) -> dict[str, torch.Tensor]:
        state = super().trainable_state()
        if self.draft_lm_head is not None:
            state["d2t_ids"] = self.d2t_ids
        return state


def build_draft_vocab(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int,
                      draft_vocab_size: int) -> torch.Tensor:
    """The draft_vocab_size most frequent loss-masked target ids, ascending id order (t2d)."""
    counts = torch.bincount(input_ids[loss_mask.bool()].long(), minlength=vocab_size).float()
    counts += torch.arange(vocab_size, 0, -1).float() * 1e-9  # deterministic ties: low ids win
    return counts.topk(draft_vocab_size).indices.sort().values
