"""The training objective over a rollout, and the teacher-forced acceptance estimates.

Per step k: soft CE (average over valid tokens) weighted decay^(k-1), plus an optional
smooth-L1 feature loss. Metrics per step: top-1 agreement over all valid rows, E[Σ_v min(p_v,
q_v)], and the CONDITIONAL rates the engine measures: α_k = P(step k's draft = the target's
argmax | steps 1..k-1 matched at the same position), the sampled analogue weighting each row by
its chain's survival probability Π_{j<k} Σ min(p, q). The expected mean accepted length
τ_exp = 1 + Σ_k Π_{j<=k} α_j (bonus token included) uses the conditional rates, the same
definition as the engine's real τ (docs/evaluation.md), and is reported beside, never
instead of, the measured τ. A step that is invalid at a position (past its sequence, or a
non-assistant label) ends that position's chain.

Stats per step (STATS columns, summed over batches and ranks): loss_k, top-1 matches, Σ min
sum, valid rows, conditional matches, conditional rows, conditional Σ min (survival weighted),
survival weight.

Like the rollout, the objective knows no head class: it reads the duck-typed attributes of
`ObjectiveHead` (every heads.DraftHead has them), so heads/base.py can route its forward here
without an import circle.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from heads.batch import PackedBatch
from heads.cod import cod_rows
from heads.loss import step_soft_ce
from heads.rollout import SteppingHead, rollout


class ObjectiveHead(SteppingHead, Protocol):
    """What the objective reads of a head beyond the rollout's needs (see heads.base)."""

    frozen: torch.nn.Module  # .norm: the target's final norm, .weight [V, H]: its lm_head

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    def draft_to_target(self) -> torch.Tensor | None: ...

    def feature_target(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def logit_inputs(self, features: torch.Tensor, prev: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


STATS = 8  # columns of the per-step stats (module docstring)


def chain_step(rows: torch.Tensor, w: torch.Tensor, chain_match: torch.Tensor | None,
               chain_beta: torch.Tensor | None):
    """One draft step's chain statistics. rows [N, 2]: per row (top-1 match, the probability
    mass the draft shares with the target, Σ min(p, q)); w [N]: row weights; chain_*: the
    previous step's products (None at step 1). Returns (chain_match, chain_beta) [N] and the conditional
    sums [4]: (all steps matched, earlier steps matched, survival, earlier survival)."""
    match, beta = rows[:, 0] * w, rows[:, 1] * w
    prior_m = w if chain_match is None else chain_match * w
    prior_b = w if chain_beta is None else chain_beta * w
    chain_match, chain_beta = prior_m * match, prior_b * beta
    cond = torch.stack([chain_match.sum(), prior_m.sum(), chain_beta.sum(), prior_b.sum()])
    return chain_match, chain_beta, cond


def head_objective(head: ObjectiveHead, batch: PackedBatch, chunk: int = 1024,
                   naive: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss, stats [K, STATS]). A P-EAGLE head with head.cod_ratio < 1 runs steps
    2..K at COD-sampled positions in training (heads/cod.py); a step's loss is then the mean
    over its rows, and its stats count them (a position dropped at step k is out of the
    conditional rates from k on)."""
    cfg = head.cfg
    cod = head.training and cfg.cod_ratio < 1
    outs = rollout(head, batch, cod_rows(batch, cfg.num_steps, cfg.cod_ratio, cfg.cod_ratio_min)
                   if cod else None)
    with torch.no_grad():
        y_all = head.frozen.norm(batch.hidden)
    w_target = head.frozen.weight
    d2t = head.draft_to_target()
    if d2t is not None:  # reduced vocabulary: the target's distribution renormalized over the
        w_target = w_target.index_select(0, d2t)  # draft's tokens needs only their rows
    total = batch.hidden.new_zeros((), dtype=torch.float32)
    stats = []
    chain_match = chain_beta = None  # per position: all earlier steps matched / survival prob
    for k, out in enumerate(outs, 1):
        valid = out.index.valid
        row_w = valid.float()
        n_valid = row_w.sum().clamp(min=1.0)
        y = y_all.index_select(0, out.index.label_rows)
        # P-EAGLE's mask steps with the transition bias read the previous step's token,
        # x_{t+k} (heads/transition.py); every other step its plain logits.
        x, w, extra = head.logit_inputs(out.features, out.index.tokens if k > 1 else None)
        ce, m, rows = step_soft_ce(x, w, y, w_target, row_w, cfg.distill_temperature, chunk,
                                   naive, extra)
        sel = out.index.rows
        if sel is None:
            chain_match, chain_beta, cond = chain_step(rows, row_w, chain_match, chain_beta)
        else:  # the chains live at every position: a step's dropped rows weigh 0
            n_all = batch.input_ids.shape[0]
            chain_match, chain_beta, cond = chain_step(
                rows.new_zeros(n_all, rows.shape[1]).index_copy(0, sel, rows),
                row_w.new_zeros(n_all).index_copy(0, sel, row_w), chain_match, chain_beta)
        loss_k = cfg.ce_loss_weight * ce / n_valid
        if cfg.feature_loss_weight > 0:
            with torch.no_grad():
                target_feat = head.feature_target(batch.hidden.index_select(0, out.index.label_rows))
            fl = F.smooth_l1_loss(out.next_hidden.float(), target_feat.float(), reduction="none")
            loss_k = loss_k + cfg.feature_loss_weight * (fl.mean(-1) * row_w).sum() / n_valid
        total = total + cfg.step_weight_decay ** (k - 1) * loss_k
        stats.append(torch.cat([loss_k.detach().reshape(1), m, cond.detach()]))
    return total, torch.stack(stats)


def summarize(stats: torch.Tensor) -> dict[str, float | list[float]]:
    """Aggregate stats [K, STATS] (summed over batches/ranks) into named metrics:
    top1_acc / exp_accept_sampled per step over all valid rows; exp_accept_greedy /
    exp_accept_sampled_cond the conditional α_k; exp_tau_greedy / exp_tau_sampled from them."""
    rows = stats[:, 3].clamp(min=1)
    top1 = (stats[:, 1] / rows).tolist()
    soft = (stats[:, 2] / rows).tolist()
    cond_g = (stats[:, 4] / stats[:, 5].clamp(min=1e-9)).tolist()
    cond_s = (stats[:, 6] / stats[:, 7].clamp(min=1e-9)).tolist()
    return {"top1_acc": top1, "exp_accept_sampled": soft,
            "exp_accept_greedy": cond_g, "exp_accept_sampled_cond": cond_s,
            "exp_tau_greedy": chain_tau(cond_g), "exp_tau_sampled": chain_tau(cond_s)}


def chain_tau(alphas: list[float]) -> float:
    """τ = 1 + Σ_k Π_{j<=k} α_j for per-position (conditional) acceptance rates α."""
    tau, run = 1.0, 1.0
    for a in alphas:
        run *= a
        tau += run
    return tau
