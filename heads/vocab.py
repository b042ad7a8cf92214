"""A reduced draft vocabulary: the V_draft target tokens a head drafts among.

Chosen by frequency over the loss-masked (assistant) tokens of the training shards: on a small
model's own answers a few thousand tokens cover nearly all of what it says, and the draft's
lm_head, the largest part of a head step (49152 x 576 on SmolLM2, a fifth of the target's
weights), shrinks by V / V_draft. Drafting maps the draft ids back to target ids (d2t); a
target token outside the draft vocabulary can never be drafted, which the engine's measured
acceptance includes.
"""
from __future__ import annotations

import torch


def build_draft_vocab(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int,
                      draft_vocab_size: int) -> torch.Tensor:
    """The draft_vocab_size most frequent loss-masked target ids, ascending id order (t2d)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"head.draft_vocab_size={draft_vocab_size} must be in 1..{vocab_size} "
                         "(the target vocabulary)")
    counts = torch.bincount(input_ids[loss_mask.bool()].long(), minlength=vocab_size).float()
    counts += torch.arange(vocab_size, 0, -1).float() * 1e-9  # deterministic ties: low ids win
    return counts.topk(draft_vocab_size).indices.sort().values


def vocab_coverage(input_ids: torch.Tensor, loss_mask: torch.Tensor, draft_vocab: torch.Tensor,
                   vocab_size: int) -> float:
    """Fraction of loss-masked tokens that lie inside the draft vocabulary."""
    ids = input_ids[loss_mask.bool()].long()
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_vocab.long()] = True
    return float(inside[ids].float().mean()) if ids.numel() else 0.0
