"""The training objective over a rollout, and the teacher-forced acceptance estimates.

Per step k: soft CE (average over valid tokens) weighted decay^(k-1), plus an optional
smooth-L1 feature loss. Metrics per step: top-1 agreement (greedy expected acceptance α_k),
E[Σ_v min(p_v, q_v)] (sampled expected acceptance), and the expected mean accepted length
τ_exp = 1 + Σ_k Π_{j<=k} α_j (bonus token included), reported beside, never instead of, the
engine's measured τ.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from heads.base import DraftHead
from heads.loss import soft_ce, soft_ce_reference
from heads.rollout import PackedBatch, rollout


def head_objective(head: DraftHead, batch: PackedBatch, chunk: int = 1024,
                   naive: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss, stats [K, 4]: loss_k, top-1 matches, sum min(p,q), valid rows)."""
    cfg = head.cfg
    outs = rollout(head, batch)
    with torch.no_grad():
        y_all = head.frozen.norm(batch.hidden)
    t2d = head.draft_to_target()
    total = batch.hidden.new_zeros((), dtype=torch.float32)
    stats = []
    for k, out in enumerate(outs, 1):
        valid = out.index.valid
        row_w = valid.float()
        n_valid = row_w.sum().clamp(min=1.0)
        y = y_all.index_select(0, out.index.label_rows)
        if naive:
            ce = soft_ce_reference(out.features, head.lm_head_weight, y, head.frozen.weight, row_w,
                                   t2d, cfg.temperature)
            with torch.no_grad():
                _, m = soft_ce(out.features.detach(), head.lm_head_weight.detach(), y,
                               head.frozen.weight, row_w, t2d, cfg.temperature, chunk)
        else:
            ce, m = soft_ce(out.features, head.lm_head_weight, y, head.frozen.weight, row_w, t2d,
                            cfg.temperature, chunk)
        loss_k = cfg.ce_loss_weight * ce / n_valid
        if cfg.feature_loss_weight > 0:
            with torch.no_grad():
                target_feat = head.feature_target(batch.hidden.index_select(0, out.index.label_rows))
            fl = F.smooth_l1_loss(out.next_hidden.float(), target_feat.float(), reduction="none")
            loss_k = loss_k + cfg.feature_loss_weight * (fl.mean(-1) * row_w).sum() / n_valid
        total = total + cfg.step_weight_decay ** (k - 1) * loss_k
        stats.append(torch.cat([loss_k.detach().reshape(1), m]))
    return total, torch.stack(stats)


def summarize(stats: torch.Tensor) -> dict[str, float | list[float]]:
    """Aggregate stats [K, 4] (summed over batches/ranks) into named metrics."""
    rows = stats[:, 3].clamp(min=1)
    top1 = (stats[:, 1] / rows).tolist()
    soft = (stats[:, 2] / rows).tolist()
    tau_g = tau_s = 1.0
    run_g = run_s = 1.0
    for a_g, a_s in zip(top1, soft):
        run_g *= a_g
        run_s *= a_s
        tau_g += run_g
        tau_s += run_s
    return {"top1_acc": top1, "exp_accept_sampled": soft,
            "exp_tau_greedy": tau_g, "exp_tau_sampled": tau_s}
