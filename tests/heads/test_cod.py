"""COD sampling for P-EAGLE training (heads/cod.py, head.cod_ratio): nested, sized and seeded
subsets; a rollout over them computes each kept row exactly as the full rollout does (the
attention of a subset step sees what it would see in full); the objective counts the kept rows
only, its gradient reaches the head, and validation runs every position."""
from __future__ import annotations

import pytest
import torch

from heads.batch import PackedBatch
from heads.cod import cod_rows, retention
from heads.config import HeadConfig
from heads.registry import build_head
from heads.rollout import rollout, step_indices


def _batch(lens=(23, 9, 16), seed=0, draw_seed=11):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return PackedBatch(torch.randint(0, 300, (n,), generator=g), torch.randn(n, 64, generator=g),
                       torch.rand(n, generator=g) > 0.2, list(lens),
                       torch.randn(n, 3, 64, generator=g), draw_seed=draw_seed)


def _peagle(parts, layers=2, **kw):
    head = build_head(HeadConfig(type="eagle3", parallel_drafting=True, num_steps=4,
                                 num_layers=layers, aux_layers=[0, 1, 2], **kw), parts, seed=4)
    with torch.no_grad():  # trained-looking norms and mask state: outputs that depend on them
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or name == "mask_hidden":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return head


def test_cod_rows_are_nested_sized_and_seeded():
    n = 6000
    b = PackedBatch(torch.zeros(n, dtype=torch.long), torch.zeros(n, 4), torch.ones(n, dtype=torch.bool),
                    [n], draw_seed=5)
    rows = cod_rows(b, 6, 0.7, 0.2)
    assert len(rows) == 5
    prev = set(range(n))
    for k, r in enumerate(rows, 2):
        assert r.tolist() == sorted(set(r.tolist())) and set(r.tolist()) <= prev
        assert abs(r.numel() / n - max(0.7 ** (k - 1), 0.2)) < 0.03
        prev = set(r.tolist())
    assert retention(5, 0.7, 0.2) == 0.7 ** 4 and retention(6, 0.7, 0.2) == 0.2
    again = cod_rows(b, 6, 0.7, 0.2)
    assert all(torch.equal(x, y) for x, y in zip(rows, again))  # the micro-batch's own seed
    b.draw_seed = 6
    assert not torch.equal(cod_rows(b, 6, 0.7, 0.2)[0], rows[0])
    full = cod_rows(b, 3, 1.0, 0.0)
    assert all(r.numel() == n for r in full)


@pytest.mark.parametrize("layers,markov", [(1, 0), (2, 8)])
def test_cod_rollout_rows_equal_the_full_rollout(parts, layers, markov):
    head = _peagle(parts, layers, markov_rank=markov).eval()
    b = _batch()
    rows = cod_rows(b, 4, 0.5, 0.0)
    assert 0 < rows[-1].numel() < rows[0].numel() < b.input_ids.numel()
    with torch.no_grad():
        full, part = rollout(head, b), rollout(head, b, rows)
    torch.testing.assert_close(part[0].features, full[0].features)
    for k, sel in enumerate(rows, 1):
        torch.testing.assert_close(part[k].features, full[k].features[sel])
        torch.testing.assert_close(part[k].next_hidden, full[k].next_hidden[sel])
        want = step_indices(b, k + 1)
        assert torch.equal(part[k].index.valid, want.valid[sel])
        assert torch.equal(part[k].index.tokens, want.tokens[sel])


def test_cod_objective_counts_kept_rows_and_trains(parts):
    b = _batch()
    head = _peagle(parts, cod_ratio=0.5, cod_ratio_min=0.2)
    rows = cod_rows(b, 4, 0.5, 0.2)  # what the objective draws for this batch (its seed)
    loss, stats = head(b)
    assert stats[0, 3] == step_indices(b, 1).valid.sum()
    for k, sel in enumerate(rows, 2):
        assert stats[k - 1, 3] == step_indices(b, k).valid[sel].sum()
    loss.backward()
    assert head.mask_hidden.grad is not None and head.mask_hidden.grad.abs().sum() > 0
    head.eval()  # validation: every position at every step
    with torch.no_grad():
        _, full = head(b)
    for k in range(1, 5):
        assert full[k - 1, 3] == step_indices(b, k).valid.sum()
    assert (full[1:, 3] > stats[1:, 3]).all()


def test_cod_config_refusals():
    with pytest.raises(ValueError, match="P-EAGLE"):
        HeadConfig(type="eagle3", aux_layers=[0], cod_ratio=0.7)
    with pytest.raises(ValueError, match="P-EAGLE"):
        HeadConfig(type="dflash", cod_ratio=0.7)
    with pytest.raises(ValueError, match=r"cod_ratio must be in \(0, 1\]"):
        HeadConfig(type="eagle3", parallel_drafting=True, cod_ratio=0.0)
    with pytest.raises(ValueError, match="cod_ratio_min"):
        HeadConfig(type="eagle3", parallel_drafting=True, cod_ratio=0.7, cod_ratio_min=1.5)
    assert HeadConfig(type="eagle3", parallel_drafting=True, cod_ratio=0.7).cod_ratio_min == 0.0
