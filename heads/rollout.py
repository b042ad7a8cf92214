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
    """For one step k: token ids [N], label rows [N] (index of h_{t+k}), valid [N] bool."""

    tokens: torch.Tensor
    label_rows: torch.Tensor
    valid: torch.Tensor


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


def rollout(head: SteppingHead, batch: PackedBatch) -> list[StepOutput]:
    """Run K = head.cfg.num_steps draft steps over a packed batch (autograd-friendly)."""
    outs = []
    hidden_in = head.first_hidden(batch.hidden, batch.aux)
    ctx = RolloutContext(RolloutPlan(batch.seq_lens, batch.input_ids.device),
                         head.rope_cos, head.rope_sin) if head.attends else None
    for k in range(1, head.cfg.num_steps + 1):
        idx = step_indices(batch, k)
        nxt, feats = head.step(idx.tokens, hidden_in, ctx, k=k)
        outs.append(StepOutput(feats, nxt, idx))
        hidden_in = nxt
        if ctx is not None:
            ctx.next_step()
    return outs
