"""The in-block transition bias of a block drafter (DSpark's "Markov head", head.markov_rank):
a block pass drafts d_2..d_K without reading the drafts before them, so two likely tokens
that never follow each other can both be drafted ("of problem" for "of course"). A low-rank
bias on the logits of d_k, read from the token drawn just before it, gives the block that
dependency back at the cost of one [r] x [r, V_draft] product per draft:

    logits(d_k) = lm_head(features_k) + U[d_{k-1}] @ W^T      k >= 2
    U [V_draft, r]: one row per draft token, W [V_draft, r]

U needs no row outside the draft vocabulary: in the engine d_{k-1} is a draft, always one of
its tokens; in training a previous data token outside it gets no bias (a draft after it is
never reached, since no draft can equal that token). With a reduced vocabulary this keeps U
V / V_draft times smaller than a table over the target's (6x on SmolLM2 at 8192 tokens), which
is most of what the bias costs a training step.

d_1 keeps the pass's own law (its previous token, the last verified one, is the block's
anchor or the chain step's input already), unless head.markov_first (DFlash): then d_1 is
biased from the anchor too, as DSpark's Markov head is, and U holds a row for every target
token, since the anchor can be any (the table speculators' "dspark" format stores). W starts
at zero, so a head starts as the same head without the bias. In training d_{k-1} is the
data's token x_{k-1} (teacher forcing: a draft counts only when every draft before it was
accepted, i.e. equal to the data's token under greedy self-distillation); in the engine it
is the drawn draft, so the law each draft is drawn from (and verified against) is computed
after the token before it: lossless as any chain.

Training folds the bias into the lm_head product: [features ; U[prev]] @ [lm_head ; W]^T is
the biased logits, and heads/loss.py's chunked soft CE takes W as extra weight columns
(`w_extra`), forming the gradients of U's rows and W in its one pass over the vocabulary.
"""
from __future__ import annotations

import torch
from torch import nn


class TransitionBias(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab: torch.Tensor | None, rank: int,
                 like: torch.Tensor, any_prev: bool = False) -> None:
        """draft_vocab: the reduced vocabulary's target ids [V_draft], or None (all V).
        any_prev: the previous token may be any target token (head.markov_first: d_1's is the
        block's anchor), so U keeps a row for each of the V."""
        super().__init__()
        rows = vocab_size if draft_vocab is None else draft_vocab.numel()
        # Initialized by DraftHead.init_parameter: U unit normal, W zero.
        self.prev = nn.Parameter(like.new_empty(vocab_size if any_prev else rows, rank))  # U
        self.out = nn.Parameter(like.new_empty(rows, rank))  # W
        if draft_vocab is None or any_prev:
            self.row_of = None
        else:  # target id -> U's row, -1 outside the draft vocabulary; [V]
            row_of = torch.full((vocab_size,), -1, dtype=torch.long, device=like.device)
            row_of[draft_vocab.long()] = torch.arange(rows, device=like.device)
            self.register_buffer("row_of", row_of, persistent=False)

    def embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens [R] target ids -> U's rows [R, r], zero for a token outside the draft
        vocabulary."""
        if self.row_of is None:
            return self.prev[prev_tokens]
        idx = self.row_of[prev_tokens]
        inside = (idx >= 0).unsqueeze(-1).to(self.prev.dtype)
        return self.prev[idx.clamp_min(0)] * inside

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens [R] target ids -> the bias [R, V_draft] fp32 on the logits of the next draft."""
        return (self.embed(prev_tokens) @ self.out.t()).float()

    def fold(self, features: torch.Tensor, prev_tokens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """features [R, H], prev_tokens [R] -> (x [R, H + r], W [V_draft, r]): the biased
        logits are x[:, :H] @ lm_head^T + x[:, H:] @ W^T (soft_ce's w_extra), each weight
        with its own gradient, so a frozen lm_head stays without one."""
        return torch.cat([features, self.embed(prev_tokens).to(features.dtype)], -1), self.out

    def _load_from_state_dict(self, state, prefix, *args, **kwargs):
        # Heads saved before U was cut to the draft vocabulary hold it over all V target ids;
        # the engine only ever read its draft tokens' rows, so those rows are the same head.
        key = prefix + "prev"
        u = state.get(key)
        if (self.row_of is not None and u is not None and u.dim() == 2
                and u.shape[0] == self.row_of.shape[0] != self.prev.shape[0]):
            inside = self.row_of >= 0
            rows = u.new_empty(self.prev.shape)
            rows[self.row_of[inside]] = u[inside]
            state[key] = rows
        super()._load_from_state_dict(state, prefix, *args, **kwargs)
