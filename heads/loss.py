"""Soft cross-entropy against the target's distribution, chunked over tokens.

The target distribution p_{t+k} is recomputed on the fly from the stored hidden states
through the frozen final norm and lm_head. Full-vocabulary fp32 logits of a whole batch
(N x V, e.g. 16k x 128k = 8 GB) are never held: forward and backward walk `chunk` rows at a
time, and backward recomputes a chunk's logits instead of saving them.
"""
from __future__ import annotations

import torch


def _chunk_stats(x, w, y_normed, w_target, t2d, temperature):
    """Draft log-probs and target probs for one chunk (both [n, V_draft], fp32)."""
    logq = torch.log_softmax((x @ w.t()).float() / temperature, dim=-1)
    with torch.no_grad():
        zp = (y_normed @ w_target.t()).float() / temperature
        if t2d is not None:
            zp = zp[:, t2d]  # reduced vocabulary: renormalize over the draft's tokens
        p = torch.softmax(zp, dim=-1)
    return logq, p


class ChunkedSoftCE(torch.autograd.Function):
    """sum_rows row_w * CE(p, q). Returns (loss, metrics [3]: top-1 matches, sum min(p,q),
    valid rows); metrics are not differentiable.

    The gradient is computed in the same chunk pass as the loss (the loss is a plain sum, so
    backward only scales it by grad_loss): each chunk's logits are formed once, never saved.
    """

    @staticmethod
    def forward(ctx, x, w, y_normed, w_target, row_w, t2d, temperature, chunk):
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        metrics = torch.zeros(3, dtype=torch.float32, device=x.device)
        gx = torch.zeros_like(x) if want_x else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        for s in range(0, x.shape[0], chunk):
            rw = row_w[s:s + chunk]
            live = rw != 0
            if not bool(live.any()):
                continue
            xs = x[s:s + chunk]
            logq, p = _chunk_stats(xs, w, y_normed[s:s + chunk], w_target, t2d, temperature)
            q = logq.exp()
            loss += (-(p * logq).sum(-1) * rw).sum()
            metrics[0] += (logq.argmax(-1) == p.argmax(-1))[live].float().sum()
            metrics[1] += torch.minimum(p, q).sum(-1)[live].sum()
            metrics[2] += live.float().sum()
            if want_x or want_w:
                # d(-sum p log softmax(z/T))/dz = (q - p) / T
                g = (q - p) * (rw / temperature).unsqueeze(-1)
                if want_x:
                    gx[s:s + chunk] = (g.to(w.dtype) @ w).to(x.dtype)
                if want_w:
                    gw += g.t() @ xs.float()
        ctx.save_for_backward(gx, gw)
        ctx.w_dtype = w.dtype
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        gx, gw = ctx.saved_tensors
        gx = None if gx is None else gx * grad_loss.to(gx.dtype)
        gw = None if gw is None else (gw * grad_loss).to(ctx.w_dtype)
        return gx, gw, None, None, None, None, None, None


def soft_ce(x: torch.Tensor, w: torch.Tensor, y_normed: torch.Tensor, w_target: torch.Tensor,
            row_w: torch.Tensor, t2d: torch.Tensor | None = None, temperature: float = 1.0,
            chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] draft features, w [V_draft, H] draft lm_head, y_normed [N, H] target features
    after the frozen final norm, w_target [V, H] frozen lm_head, row_w [N] per-row weight
    (0 = invalid). Returns (weighted loss sum, metrics [top1 matches, sum min(p,q), rows])."""
    return ChunkedSoftCE.apply(x, w, y_normed, w_target, row_w.float(), t2d, temperature, chunk)


def soft_ce_reference(x, w, y_normed, w_target, row_w, t2d=None, temperature=1.0):
    """The naive full-logits version (tests and the training benchmark's baseline)."""
    logq = torch.log_softmax((x @ w.t()).float() / temperature, dim=-1)
    zp = (y_normed @ w_target.t()).float() / temperature
    if t2d is not None:
        zp = zp[:, t2d]
    p = torch.softmax(zp, dim=-1).detach()
    return (-(p * logq).sum(-1) * row_w.float()).sum()
