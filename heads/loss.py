"""Soft cross-entropy against the target's distribution, chunked over tokens.

The target distribution p_{t+k} is recomputed on the fly from the stored hidden states
through the frozen final norm and lm_head. Full-vocabulary fp32 logits of a whole batch
(N x V, e.g. 16k x 128k = 8 GB) are never held: the forward walks `chunk` rows at a time
and forms each chunk's gradient in the same pass, so nothing V-sized is saved for backward.
Rows of weight 0 (prompt tokens, labels past a sequence's end) are skipped altogether.

The vocabulary-sized products (three per chunk: draft logits, target logits, the gradient
into the features) are nearly all of a step's arithmetic on CPU, and in fp32 there they run
on OpenBLAS (numpy) rather than torch's MKL, which takes its slow path on AMD CPUs: on the
2-core EPYC a [1024, 576] x [576, 49152] chunk product ran 0.32 s on OpenBLAS against 0.55 s
on MKL (182 against 105 GFLOP/s), the gradient's [1024, 49152] x [49152, 576] 0.28 s
against 0.36.
"""
from __future__ import annotations

import numpy as np
import torch


# From this many elements of the vocabulary-sized operand (SmolLM2's lm_head: 28.3M; a
# reduced 8192-token vocabulary: 4.7M) the products go to OpenBLAS, which was measured on the
# full lm_head only; smaller ones (reduced vocabularies, the tests' tiny targets) stay on
# torch's path, whose sums they were checked with.
OPENBLAS_MIN_ELEMENTS = 1 << 24


def openblas_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a @ b runs on OpenBLAS: CPU fp32 outside autocast (which would have torch
    multiply in bf16), b of at least OPENBLAS_MIN_ELEMENTS."""
    return (a.device.type == "cpu" and a.dtype == b.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and b.numel() >= OPENBLAS_MIN_ELEMENTS)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, k] @ b [k, m] (any strides: transposed views are read in place) -> [n, m], on
    OpenBLAS where openblas_applies (module docstring), else torch. Called without autograd
    (ChunkedSoftCE forms its own gradient), so inputs that require grad are read detached."""
    if openblas_applies(a, b):
        return torch.from_numpy(np.matmul(a.detach().numpy(), b.detach().numpy()))
    return a @ b


def _chunk_stats(x, w, y_normed, w_target, t2d, temperature, w_extra=None):
    """Draft log-probs and target probs for one chunk (both [n, V_draft], fp32). w_extra
    [V_draft, r]: x's last r columns multiply it (soft_ce).

    Every [n, V] temporary is written in place where it can be: at V = 128k each one is
    0.5 GB per 1k rows, and a pass over it costs as much as the elementwise math in it."""
    if w_extra is None:
        z = _mm(x, w.t()).float()
    else:
        h = w.shape[1]
        z = _mm(x[:, :h], w.t()).float().add_(_mm(x[:, h:], w_extra.t()).float())
    if temperature != 1.0:
        z.div_(temperature)
    logq = torch.log_softmax(z, dim=-1)
    del z
    with torch.no_grad():
        zp = _mm(y_normed, w_target.t()).float()
        if temperature != 1.0:
            zp.div_(temperature)
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
    def forward(ctx, x, w, w_extra, y_normed, w_target, row_w, t2d, temperature, chunk):
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_e = ctx.needs_input_grad[2]
        h = w.shape[1]
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        metrics = torch.zeros(3, dtype=torch.float32, device=x.device)
        # Per row: [top-1 match, sum min(p, q)], for the conditional (chain) acceptance.
        rowstats = torch.zeros(x.shape[0], 2, dtype=torch.float32, device=x.device)
        gx = torch.zeros_like(x) if want_x else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        ge = (torch.zeros(w_extra.shape, dtype=torch.float32, device=w.device) if want_e
              else None)
        # Rows of weight 0 (prompt tokens, positions whose label lies past their sequence)
        # carry no loss and no gradient: logits are formed for the live rows only.
        rows = row_w.nonzero().squeeze(-1)
        for s in range(0, rows.numel(), chunk):
            idx = rows[s:s + chunk]
            rw = row_w[idx]
            xs = x[idx]
            logq, p = _chunk_stats(xs, w, y_normed[idx], w_target, t2d, temperature, w_extra)
            # Row dot products sum_v p log q without an [n, V] product temporary.
            loss -= (torch.bmm(p.unsqueeze(1), logq.unsqueeze(2)).view(-1) * rw).sum()
            match = (logq.argmax(-1) == p.argmax(-1)).float()
            metrics[0] += match.sum()
            q = logq.exp_()  # logq is not needed after this: q takes its memory
            beta = torch.minimum(p, q).sum(-1)
            metrics[1] += beta.sum()
            metrics[2] += idx.numel()
            rowstats.index_copy_(0, idx, torch.stack([match, beta], -1))
            if want_x or want_w or want_e:
                # d(-sum p log softmax(z/T))/dz = (q - p) / T
                g = q.sub_(p).mul_((rw / temperature).unsqueeze(-1))
                if want_x:
                    gxs = _mm(g.to(w.dtype), w).to(x.dtype)
                    if w_extra is not None:
                        gxs = torch.cat([gxs, _mm(g.to(w_extra.dtype), w_extra).to(x.dtype)], -1)
                    gx.index_copy_(0, idx, gxs)
                if want_w:
                    gw += _mm(g.t(), xs[:, :h].float())
                if want_e:
                    ge += _mm(g.t(), xs[:, h:].float())
        ctx.save_for_backward(gx, gw, ge)
        ctx.w_dtype = w.dtype
        ctx.e_dtype = None if w_extra is None else w_extra.dtype
        ctx.mark_non_differentiable(metrics, rowstats)
        return loss, metrics, rowstats

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics, _grad_rows):
        gx, gw, ge = ctx.saved_tensors
        gx = None if gx is None else gx * grad_loss.to(gx.dtype)
        gw = None if gw is None else (gw * grad_loss).to(ctx.w_dtype)
        ge = None if ge is None else (ge * grad_loss).to(ctx.e_dtype)
        return gx, gw, ge, None, None, None, None, None, None


def soft_ce(x: torch.Tensor, w: torch.Tensor, y_normed: torch.Tensor, w_target: torch.Tensor,
            row_w: torch.Tensor, t2d: torch.Tensor | None = None, temperature: float = 1.0,
            chunk: int = 1024, with_rows: bool = False, w_extra: torch.Tensor | None = None):
    """x [N, H] draft features, w [V_draft, H] draft lm_head, y_normed [N, H] target features
    after the frozen final norm, w_target [V, H] frozen lm_head, row_w [N] per-row weight
    (0 = invalid). Returns (weighted loss sum, metrics [top1 matches, sum min(p,q), rows]),
    and with_rows: also [N, 2] per-row (top-1 match, sum min(p, q)), zero on invalid rows.
    w_extra [V_draft, r]: more weight columns for x's last r columns (x [N, H + r]): the
    logits are x[:, :H] @ w^T + x[:, H:] @ w_extra^T, and each factor gets its own gradient,
    so a frozen w stays without one (the transition bias, heads/transition.py)."""
    loss, metrics, rows = ChunkedSoftCE.apply(x, w, w_extra, y_normed, w_target, row_w.float(),
                                              t2d, temperature, chunk)
    return (loss, metrics, rows) if with_rows else (loss, metrics)


def step_soft_ce(x, w, y_normed, w_target, row_w, temperature: float, chunk: int,
                 naive: bool = False, w_extra=None, stat_w=None):
    """One draft step of a training objective -> soft_ce(..., with_rows=True)'s (loss sum,
    metrics, per-row stats). naive: the loss (and its gradient) from soft_ce_reference, the
    stats from a chunked pass without gradient, weighted by stat_w (default row_w)."""
    if not naive:
        return soft_ce(x, w, y_normed, w_target, row_w, None, temperature, chunk,
                       with_rows=True, w_extra=w_extra)
    loss = soft_ce_reference(x, w, y_normed, w_target, row_w, None, temperature, w_extra)
    with torch.no_grad():
        _, metrics, rows = soft_ce(x.detach(), w.detach(), y_normed, w_target,
                                   row_w if stat_w is None else stat_w, None, temperature, chunk,
                                   with_rows=True,
                                   w_extra=None if w_extra is None else w_extra.detach())
    return loss, metrics, rows


def soft_ce_reference(x, w, y_normed, w_target, row_w, t2d=None, temperature=1.0,
                      w_extra=None):
    """The naive full-logits version (tests and the training benchmark's baseline)."""
    if w_extra is not None:
        w = torch.cat([w, w_extra.to(w.dtype)], -1)
    logq = torch.log_softmax((x @ w.t()).float() / temperature, dim=-1)
    zp = (y_normed @ w_target.t()).float() / temperature
    if t2d is not None:
        zp = zp[:, t2d]
    p = torch.softmax(zp, dim=-1).detach()
    return (-(p * logq).sum(-1) * row_w.float()).sum()
