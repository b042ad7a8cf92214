"""Multi-step training rollout. The alignment table below is the contract every head step, the
shards and the engine's head drafter share (tests/heads/test_heads.py asserts it).

Step k (1-based) at position t of a packed sequence (local index i, length n):
  hidden input: h_t from the target (k = 1) or the head's step k-1 output at t
  token input : x_{t+k}            (a pad id when i + k >= n; such rows are never valid)
  predicts    : x_{t+k+1}, soft label p_{t+k} = softmax(lm_head(final_norm(h_{t+k})))
  valid when  : i + k + 1 < n and loss_mask[t+k+1]
No index ever crosses a sequence boundary: every shifted index is checked against its own
sequence's length before use.

The rollout knows no head class: it drives any object with the `SteppingHead` attributes
(every heads.DraftHead), so a head kind changes nothing here. Heads that do not attend
(`attends = False`, Medusa) get ctx=None instead of a rollout attention context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from heads.batch import PackedBatch
from heads.config import HeadConfig
from heads.rollout_attention import RolloutContext, RolloutPlan


class SteppingHead(Protocol):
    """What the rollout reads of a head (heads.base.DraftHead has all of it)."""

    attends: bool  # False: step() never reads ctx, and the rollout passes None
    cfg: HeadConfig  # num_steps: K
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor: ...

    def step(self, tokens: torch.Tensor, hidden_in: torch.Tensor, ctx,
             k: int = 1) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class StepIndex:
    """For one step k over the n positions it runs at: token ids [n], label rows [n] (index of
    h_{t+k}), valid [n] bool; rows [n]: those positions, when a subset (COD), else None (all N)."""

    tokens: torch.Tensor
    label_rows: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor | None = None

    def subset(self, rows: torch.Tensor) -> "StepIndex":
        return StepIndex(self.tokens[rows], self.label_rows[rows], self.valid[rows], rows)


def step_indices(batch: PackedBatch, k: int) -> StepIndex:
    n_tok = batch.input_ids.shape[0]
    dev = batch.input_ids.device
    lens = torch.tensor(batch.seq_lens, device=dev)
    seq_len = lens.repeat_interleave(lens)  # [N] length of each token's sequence
    starts = torch.cumsum(lens, 0) - lens
    local = torch.arange(n_tok, device=dev) - starts.repeat_interleave(lens)
    t = torch.arange(n_tok, device=dev)
    last = n_tok - 1
    tok_ok = local + k < seq_len
    tokens = torch.where(tok_ok, batch.input_ids[(t + k).clamp(max=last)], 0)
    valid = (local + k + 1 < seq_len) & batch.loss_mask[(t + k + 1).clamp(max=last)].bool()
    return StepIndex(tokens=tokens, label_rows=(t + k).clamp(max=last), valid=valid)


@dataclass
class StepOutput:
    features: torch.Tensor  # [N, H] -> lm_head
    next_hidden: torch.Tensor  # [N, H]
    index: StepIndex


def rollout(head: SteppingHead, batch: PackedBatch,
            rows: list[torch.Tensor] | None = None) -> list[StepOutput]:
    """Run K = head.cfg.num_steps draft steps over a packed batch (autograd-friendly). rows:
    None (every step at every position), or [S_2, ..., S_K], the positions steps 2..K run at,
    each a subset of the one before (COD, heads/cod.py); a step's outputs then hold its rows
    only, each equal to the full rollout's at that position."""
    outs = []
    hidden = head.first_hidden(batch.hidden, batch.aux)  # [N, H]: the last output at each position
    ctx = RolloutContext(RolloutPlan(batch.seq_lens, batch.input_ids.device),
                         head.rope_cos, head.rope_sin) if head.attends else None
    for k in range(1, head.cfg.num_steps + 1):
        idx = step_indices(batch, k)
        sel = None if rows is None or k == 1 else rows[k - 2]
        if sel is not None:
            idx = idx.subset(sel)
            if ctx is not None:
                ctx.select(sel)
        nxt, feats = head.step(idx.tokens, hidden if sel is None else hidden[sel], ctx, k=k)
        outs.append(StepOutput(feats, nxt, idx))
        hidden = nxt if sel is None else hidden.index_copy(0, sel, nxt)
        if ctx is not None:
            ctx.next_step()
    return outs
