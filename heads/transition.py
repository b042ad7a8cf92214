"""The in-block transition bias of a block drafter (DSpark's "Markov head", head.markov_rank):
a block pass drafts d_2..d_K without reading the drafts before them, so two likely tokens
that never follow each other can both be drafted ("of problem" for "of course"). A low-rank
bias on the logits of d_k, read from the token drawn just before it, gives the block that
dependency back at the cost of one [r] x [r, V_draft] product per draft:

    logits(d_k) = lm_head(features_k) + U[d_{k-1}] @ W^T      k >= 2
    U [V, r]: one row per target token (d_{k-1} is any target token), W [V_draft, r]

d_1 keeps the pass's own law (its previous token, the last verified one, is the block's
anchor or the chain step's input already). W starts at zero, so a head starts as the same head
without the bias. In training d_{k-1} is the data's token x_{k-1} (teacher forcing: a draft
counts only when every draft before it was accepted, i.e. equal to the data's token under
greedy self-distillation); in the engine it is the drawn draft, so the law each draft is
drawn from (and verified against) is computed after the token before it: lossless as any
chain.

Training folds the bias into the lm_head product: [features ; U[prev]] @ [lm_head ; W]^T is
the biased logits, and heads/loss.py's chunked soft CE takes W as extra weight columns
(`w_extra`), forming the gradients of U's rows and W in its one pass over the vocabulary.
"""
from __future__ import annotations

import torch
from torch import nn


class TransitionBias(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab: int, rank: int, like: torch.Tensor) -> None:
        super().__init__()
        # Initialized by DraftHead.init_parameter: U unit normal, W zero.
        self.prev = nn.Parameter(like.new_empty(vocab_size, rank))  # U
        self.out = nn.Parameter(like.new_empty(draft_vocab, rank))  # W

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens [R] target ids -> the bias [R, V_draft] fp32 on the logits of the next draft."""
        return (self.prev[prev_tokens] @ self.out.t()).float()

    def fold(self, features: torch.Tensor, prev_tokens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """features [R, H], prev_tokens [R] -> (x [R, H + r], W [V_draft, r]): the biased
        logits are x[:, :H] @ lm_head^T + x[:, H:] @ W^T (soft_ce's w_extra), each weight
        with its own gradient, so a frozen lm_head stays without one."""
        return torch.cat([features, self.prev[prev_tokens].to(features.dtype)], -1), self.out
