"""The trainer's loss (heads/loss.py ChunkedSoftCE), as the step uses it: rows of weight 0 are
skipped, yet loss, gradients and the acceptance metrics equal the full-logits reference."""
from __future__ import annotations

import pytest
import torch

from heads.loss import soft_ce, soft_ce_reference


@pytest.mark.parametrize("reduced", [False, True])
def test_chunked_loss_skipping_dead_rows_matches_reference(reduced):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(41, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g)
    y, wt = torch.randn(41, 16, generator=g), torch.randn(50, 16, generator=g)
    rw = (torch.rand(41, generator=g) > 0.4).float() * 0.8
    rw[:7] = 0  # a whole dead chunk
    t2d = torch.tensor([0, 3, 8, 15, 22, 30, 49]) if reduced else None
    w_use = w[:7].clone() if reduced else w
    got, metrics = soft_ce(x, w_use, y, wt, rw, t2d, temperature=0.7, chunk=6)
    (gx,) = torch.autograd.grad(got, [x])
    ref = soft_ce_reference(x, w_use, y, wt, rw, t2d, temperature=0.7)
    (gx_ref,) = torch.autograd.grad(ref, [x])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    assert gx[rw == 0].abs().max() == 0

    with torch.no_grad():
        q = torch.softmax(x @ w_use.t() / 0.7, -1)
        zp = y @ wt.t() / 0.7
        p = torch.softmax(zp if t2d is None else zp[:, t2d], -1)
    live = rw != 0
    want = torch.stack([(q.argmax(-1) == p.argmax(-1))[live].float().sum(),
                        torch.minimum(p, q).sum(-1)[live].sum(), live.float().sum()])
    torch.testing.assert_close(metrics, want, rtol=1e-5, atol=1e-5)


def test_all_rows_dead_gives_zero_loss_and_gradient():
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(20, 8)
    loss, metrics = soft_ce(x, w, torch.randn(5, 8), w, torch.zeros(5), chunk=2)
    loss.backward()
    assert loss.item() == 0 and metrics.tolist() == [0, 0, 0]
    assert x.grad.abs().max() == 0


def test_vocabulary_products_on_openblas_match_the_reference(monkeypatch):
    """At a vocabulary past heads.loss.OPENBLAS_MIN_ELEMENTS the chunk products run on
    OpenBLAS (numpy): loss and gradient still equal the full-logits reference; under CPU
    autocast they stay on torch's (bf16) path."""
    import numpy as np

    from heads import loss as loss_mod
    calls = []
    matmul = np.matmul
    monkeypatch.setattr(loss_mod.np, "matmul", lambda a, b: calls.append(b.shape) or matmul(a, b))
    g = torch.Generator().manual_seed(3)
    vocab, hidden = (1 << 24) // 256, 256
    x = torch.randn(40, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g) * 0.05
    y, wt = torch.randn(40, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * 0.05
    rw = (torch.rand(40, generator=g) > 0.3).float()
    got, _ = soft_ce(x, w, y, wt, rw, chunk=16)
    (gx,) = torch.autograd.grad(got, [x])
    assert len(calls) == 3 * 2 and all(vocab in shape for shape in calls)  # 2 live chunks
    ref = soft_ce_reference(x, w, y, wt, rw)
    (gx_ref,) = torch.autograd.grad(ref, [x])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        soft_ce(x, w, y, wt, rw, chunk=16)
    assert calls == []
