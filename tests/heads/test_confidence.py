"""DSpark's confidence head on a DFlash head (head.confidence_head, heads/dflash.py): its loss
against a per-row loop (BCE of the logit against the draft's acceptance rate Σ min(p, q)),
and that it only learns to read the drafter: every other weight gets the gradient of the
same head without it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heads.batch import PackedBatch
from heads.block_objective import block_labels, sample_anchors
from heads.config import HeadConfig
from heads.registry import build_head

AUX = [0, 1, 2]
BASE = dict(type="dflash", num_steps=3, num_layers=1, aux_layers=AUX, anchors_per_seq=1000)


def _batch(lens=(11, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return PackedBatch(torch.randint(0, 300, (n,), generator=g), torch.randn(n, 64, generator=g),
                       torch.rand(n, generator=g) > 0.2, list(lens), torch.randn(n, 3, 64, generator=g))


def _pair(parts, **kw):
    """(a head with the confidence head, its twin without): the same seed draws the same
    other weights (the confidence head draws last)."""
    heads = [build_head(HeadConfig(**BASE, **kw, confidence_head=c), parts, seed=2) for c in (True, False)]
    with torch.no_grad():  # a confidence head away from its start, and a trained-looking bias
        heads[0].confidence.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
        heads[0].confidence.bias.fill_(-0.5)
        for h in heads:
            if h.transition is not None:
                h.transition.out.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(4))
    return heads


@pytest.mark.parametrize("markov", [{}, dict(markov_rank=4, markov_first=True)])
def test_confidence_loss_is_the_bce_of_each_draft_row(parts, markov):
    """The objective's extra term, row by row: BCE(logit of [features ; U[prev]], Σ_v min(p_v,
    q_v) of the target's law p and the draft's q), over the valid rows, weighted by
    exp(-(k-1)/γ) as the drafts' CE."""
    head, plain = _pair(parts, **markov)
    head.eval(), plain.eval()  # every anchor: the same blocks in both
    batch = _batch()
    with torch.no_grad():
        got = float(head(batch)[0] - plain(batch)[0])
        anchors = sample_anchors(batch, None)
        feats = head.train_blocks(batch.aux, batch.seq_lens, batch.input_ids, anchors)
        y = head.frozen.norm(batch.hidden)
        want = 0.0
        for k in range(1, head.block_size):
            rows, valid = block_labels(batch, anchors, k)
            total, n = 0.0, 0
            for j in valid.nonzero().flatten().tolist():
                prev = batch.input_ids[rows[j]:rows[j] + 1]  # x_{g+k-1} (row 1: the anchor)
                z = head.logits(feats[j, k:k + 1]).float()
                if head.transition is not None:
                    z = z + head.transition(prev)
                p = torch.softmax(head.frozen.logits(y[rows[j]:rows[j] + 1], normed=True).float(), -1)
                accept = torch.minimum(p, torch.softmax(z, -1)).sum()
                logit = head.confidence_logit(feats[j, k:k + 1], prev).float()
                total += float(F.binary_cross_entropy_with_logits(logit, accept.reshape(1)))
                n += 1
            want += torch.exp(torch.tensor(-(k - 1) / head.cfg.decay_gamma)).item() * total / max(n, 1)
    assert got == pytest.approx(want, rel=1e-4)


def test_confidence_head_learns_alone(parts):
    """Its loss reaches only its own weights: every shared weight's gradient is the plain
    twin's, while the confidence head gets one."""
    head, plain = _pair(parts, markov_rank=4, markov_first=True)
    batch = _batch(seed=5)
    for h in (head, plain):
        h.train()
        torch.manual_seed(0)  # the same random anchors
        h(batch)[0].backward()
    theirs = dict(plain.named_parameters())
    for name, p in head.named_parameters():
        if name.startswith("confidence."):
            assert p.grad is not None and float(p.grad.abs().sum()) > 0
        elif p.grad is not None:
            torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-7)
