"""The training objective of DFlash blocks, with the chain heads' stats (heads/objective.py).

Anchors: a position a of a sequence (length n) can anchor a block when its first label exists
and counts: a + 1 < n and loss_mask[a + 1]. Training draws up to head.anchors_per_seq of them
per sequence at random, from the micro-batch's own seed (PackedBatch.draw_seed: the same
blocks whatever the ranks, accumulation or resumes); eval mode (validation) takes every one,
so its numbers do not depend on a draw.

Block row k = 1..K of the anchor at global index g predicts x_{g+k} with the soft label
p_{g+k-1} (heads/dflash.py's table), valid when it lies inside the sequence and
loss_mask[g+k]. Row k of every block is "step k" of the stats, so summarize() reports α_k,
τ_exp and the rest exactly as for a chain (a block's drafts are judged as a chain).

Position weights (head.position_weights):
  decay: w_k = exp(-(k-1) / decay_gamma) (DFlash), one scalar per position;
  dpace: D-PACE's per-block weights, w_k = Σ_{j>=k valid} Π_{i<=j} s_i with
         s_i = (1 - dpace_alpha) exp(-CE_i) + dpace_alpha (the draft's smoothed confidence,
         no gradient): a position counts as much as the accepted run it can still extend.
The stats' loss_k is the position's mean CE (decay) or its mean weighted CE (dpace).

With head.confidence_head the loss gains, per row k, confidence_weight x exp(-(k-1)/γ) x the
mean BCE of the confidence head's logit against the row's acceptance rate Σ min(p, q) (the
per-row statistic soft_ce already forms), on detached inputs; it is not in loss_k.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from heads.batch import PackedBatch
from heads.loss import step_soft_ce
from heads.objective import chain_step


def anchor_candidates(batch: PackedBatch) -> torch.Tensor:
    """bool [N]: which packed positions can anchor a block (see the module docstring)."""
    n_tok, dev = batch.input_ids.shape[0], batch.input_ids.device
    lens = torch.tensor(batch.seq_lens, device=dev)
    starts = torch.cumsum(lens, 0) - lens
    local = torch.arange(n_tok, device=dev) - starts.repeat_interleave(lens)
    seq_len = lens.repeat_interleave(lens)
    nxt = batch.loss_mask[(torch.arange(n_tok, device=dev) + 1).clamp(max=n_tok - 1)].bool()
    return (local + 1 < seq_len) & nxt


def sample_anchors(batch: PackedBatch, per_seq: int | None) -> torch.Tensor:
    """Anchors [J] int64 (global packed indices, ascending): up to per_seq random candidates
    of each sequence (drawn on the host from batch.draw_seed, else the global generator), or
    every candidate when per_seq is None."""
    ok = anchor_candidates(batch)
    if per_seq is None:
        return ok.nonzero().flatten()
    g = None if batch.draw_seed is None else torch.Generator().manual_seed(batch.draw_seed)
    picked, start = [], 0
    for n in batch.seq_lens:
        cand = ok[start:start + n].nonzero().flatten() + start
        if cand.numel() > per_seq:
            keep = torch.randperm(cand.numel(), generator=g)[:per_seq]
            cand = cand[keep.sort().values.to(cand.device)]
        picked.append(cand)
        start += n
    return torch.cat(picked)


def block_labels(batch: PackedBatch, anchors: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row k of each block: (label rows [J], the index of h_{g+k-1}; valid [J] bool)."""
    n_tok, dev = batch.input_ids.shape[0], anchors.device
    lens = torch.tensor(batch.seq_lens, device=dev)
    ends = torch.cumsum(lens, 0).repeat_interleave(lens)  # [N] one past each token's sequence
    label = anchors + k
    inside = label < ends[anchors]
    valid = inside & batch.loss_mask[label.clamp(max=n_tok - 1)].bool()
    return (anchors + k - 1).clamp(max=n_tok - 1), valid


@torch.no_grad()
def _row_ce(x, w, y_normed, w_target, t2d, temperature, chunk) -> torch.Tensor:
    """Per-row soft CE [n] (no gradient), chunked over rows: D-PACE's confidence input."""
    out = []
    for s in range(0, x.shape[0], chunk):
        logq = torch.log_softmax((x[s:s + chunk] @ w.t()).float() / temperature, -1)
        zp = (y_normed[s:s + chunk] @ w_target.t()).float() / temperature
        p = torch.softmax(zp if t2d is None else zp[:, t2d], -1)
        out.append(-(p * logq).sum(-1))
    return torch.cat(out) if out else x.new_zeros(0)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """ce, valid [J, K] -> D-PACE weights [J, K] (0 where invalid)."""
    m = valid.float()
    smooth = torch.where(valid, (1 - alpha) * torch.exp(-ce.float()) + alpha, torch.ones_like(m))
    prefix = torch.cumprod(smooth, dim=-1)
    return torch.flip(torch.cumsum(torch.flip(prefix * m, [-1]), -1), [-1]) * m


def _confidence_loss(head, feats: torch.Tensor, prev: torch.Tensor, accept: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """Σ over valid rows of BCE(confidence logit, the draft's acceptance rate Σ_v min(p, q))
    for one block row: feats [J, H], prev [J] the token before each draft, accept [J].
    The inputs are detached: the confidence head learns to read the drafter, never changes it."""
    logit = head.confidence_logit(feats.detach(), prev).float()
    bce = F.binary_cross_entropy_with_logits(logit, accept.detach().float().clamp(0, 1),
                                             reduction="none")
    return (bce * valid.float()).sum()


def block_objective(head, batch: PackedBatch, chunk: int = 1024,
                    naive: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """head: a heads.dflash.DFlashHead -> (loss, stats [K, STATS]) as head_objective's."""
    cfg, k_max = head.cfg, head.block_size - 1
    anchors = sample_anchors(batch, cfg.anchors_per_seq if head.training else None)
    if anchors.numel() == 0:  # no label in the batch: one block whose rows are all invalid,
        anchors = anchors.new_zeros(1)  # so the loss is 0 and still reaches every weight
    total = batch.hidden.new_zeros((), dtype=torch.float32)
    feats = head.train_blocks(batch.aux, batch.seq_lens, batch.input_ids, anchors)
    with torch.no_grad():
        y_all = head.frozen.norm(batch.hidden)
    w_target, d2t = head.frozen.weight, head.draft_to_target()
    if d2t is not None:  # the target's law renormalized over the draft vocabulary
        w_target = w_target.index_select(0, d2t)
    labels = [block_labels(batch, anchors, k) for k in range(1, k_max + 1)]
    weights = None
    # Row k's logit inputs; rows >= 2 with the transition bias read x_{g+k-1}, the token at
    # the row's label index (heads/transition.py); row 1 too with markov_first (its anchor).
    first = 1 if cfg.markov_first else 2
    inputs = [head.logit_inputs(feats[:, k], batch.input_ids[rows] if k >= first else None)
              for k, (rows, _) in enumerate(labels, 1)]
    if cfg.position_weights == "dpace":
        ce = torch.stack([_row_ce(x.detach(), w.detach() if e is None else
                                  torch.cat([w, e.to(w.dtype)], -1).detach(),
                                  y_all.index_select(0, rows), w_target, None,
                                  cfg.distill_temperature, chunk)
                          for (x, w, e), (rows, _) in zip(inputs, labels)], -1)
        weights = dpace_weights(ce, torch.stack([v for _, v in labels], -1), cfg.dpace_alpha)
    stats, chain_match, chain_beta = [], None, None
    for k, (rows, valid) in enumerate(labels, 1):
        row_w = valid.float() if weights is None else weights[:, k - 1]
        n_valid = valid.float().sum().clamp(min=1.0)
        (x, w, extra), y = inputs[k - 1], y_all.index_select(0, rows)
        ce, m, per_row = step_soft_ce(x, w, y, w_target, row_w, cfg.distill_temperature, chunk,
                                      naive, extra, stat_w=valid.float())
        chain_match, chain_beta, cond = chain_step(per_row, valid.float(), chain_match, chain_beta)
        loss_k = cfg.ce_loss_weight * ce / n_valid
        scale = math.exp(-(k - 1) / cfg.decay_gamma) if weights is None else 1.0
        total = total + scale * loss_k
        if head.confidence is not None:  # decayed as the drafts' CE (D-PACE's too: DSpark's)
            total = total + math.exp(-(k - 1) / cfg.decay_gamma) * cfg.confidence_weight * \
                _confidence_loss(head, feats[:, k], batch.input_ids[rows], per_row[:, 1],
                                 valid) / n_valid
        stats.append(torch.cat([loss_k.detach().reshape(1).float(), m.float(), cond.detach()]))
    return total, torch.stack(stats)
