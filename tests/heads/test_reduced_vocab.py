"""A reduced draft vocabulary for the MTP head (frozen target rows, mapped back to target ids
when drafting), and the conditional teacher-forced acceptance (heads/objective.py)."""
from __future__ import annotations

import pytest
import torch

import heads.loss as loss
import heads.objective as objective
from heads.batch import PackedBatch
from heads.checkpoint import load_head, save_head
from heads.config import HeadConfig
from heads.registry import build_head
from heads.rollout import rollout
from heads.vocab import build_draft_vocab, vocab_coverage
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.speculative.drafters import HeadDrafter

V_DRAFT = 40


def _batch(n=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    return PackedBatch(torch.randint(0, 300, (n,), generator=g), torch.randn(n, 64, generator=g),
                       torch.ones(n, dtype=torch.bool), [n])


def reduced_mtp(parts, seed=1):
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 300, (2000,), generator=g) % 97  # a skewed token distribution
    vocab = build_draft_vocab(ids, torch.ones_like(ids), 300, V_DRAFT)
    cfg = HeadConfig(type="mtp", num_steps=2, draft_vocab_size=V_DRAFT)
    return build_head(cfg, parts, draft_vocab=vocab, seed=seed), vocab


def test_vocab_is_the_most_frequent_loss_masked_tokens():
    ids = torch.tensor([5, 5, 5, 7, 7, 9, 1, 1, 1, 1])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0])  # token 1 is frequent but never trained
    vocab = build_draft_vocab(ids, mask, 12, 2)
    assert vocab.tolist() == [5, 7]
    assert vocab_coverage(ids, mask, vocab, 12) == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(ids, mask, 12, 13)


def test_reduced_mtp_uses_frozen_target_rows_and_stores_its_ids(parts, tmp_path):
    head, vocab = reduced_mtp(parts)
    assert head.lm_head_weight.shape == (V_DRAFT, 64) and not head.lm_head_weight.requires_grad
    torch.testing.assert_close(head.lm_head_weight, parts.lm_head[vocab], rtol=0, atol=0)
    assert "draft_lm_head" not in dict(head.named_parameters())
    state = head.trainable_state()
    assert torch.equal(state["d2t_ids"], vocab)
    save_head(head, tmp_path / "h")
    again = load_head(tmp_path / "h", parts)
    b = _batch()
    with torch.no_grad():
        a = head.logits(rollout(head, b)[0].features)
        c = again.logits(rollout(again, b)[0].features)
    torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_engine_drafts_what_the_rollout_predicts(parts):
    """Step 1 through the engine's paged drafter (target-vocabulary logits, -inf outside the
    draft vocabulary) picks the same token as the training rollout's logits mapped by d2t."""
    head, vocab = reduced_mtp(parts)
    b = _batch(n=21)
    with torch.no_grad():
        feats = rollout(head, b)[0].features
        want = vocab[head.logits(feats).argmax(-1)]
    n, page = b.input_ids.numel(), 4
    pages = -(-n // page)
    drafter = HeadDrafter(head, pages, page, "cpu", torch.float32)
    plan = TorchAttentionBackend("cpu").plan(BatchLayout([n], [n], [list(range(pages))[::-1]], page))
    tokens = torch.cat([b.input_ids[1:], b.input_ids[:1] * 0])  # x_{t+1}, as the rollout's step 1
    with torch.no_grad():
        _, logits = drafter.run(tokens, head.first_hidden(b.hidden, None), plan)
    assert logits.shape == (n, 300)
    outside = torch.ones(300, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isinf(logits[:, outside]).all()
    assert torch.equal(logits.argmax(-1)[:-1], want[:-1])  # the last row has no next token
    torch.testing.assert_close(logits[:-1, vocab], head.logits(feats)[:-1], rtol=1e-5, atol=1e-5)


def test_conditional_expected_tau_on_a_constructed_example(parts, monkeypatch):
    """One sequence of 6 tokens, K = 2. Valid rows: step 1 rows 0..3, step 2 rows 0..2.
    Matches: step 1 [1, 1, 0, 1], step 2 [1, 0, 1]; Σmin(p,q): [.5, 1, .2, 1], [.4, .5, 1].
    Conditional α_1 = 3/4, α_2 = 1/2 (rows 0, 1 survive step 1; row 0 matches), so
    τ = 1 + 3/4 + 3/8 = 2.125; unconditional step-2 top-1 is 2/3. Sampled: α_1 = 2.7/4,
    α_2 = (.5*.4 + 1*.5 + .2*1) / (.5 + 1 + .2)."""
    table = {1: ([1, 1, 0, 1], [.5, 1, .2, 1]), 2: ([1, 0, 1], [.4, .5, 1])}
    calls = []

    def fake_soft_ce(x, w, y, wt, row_w, t2d, temperature, chunk, with_rows=False, w_extra=None):
        k = len(calls) + 1
        calls.append(k)
        match, beta = table[k]
        rows = torch.zeros(x.shape[0], 2)
        rows[:len(match), 0] = torch.tensor(match, dtype=torch.float32)
        rows[:len(beta), 1] = torch.tensor(beta)
        assert row_w.tolist() == [1.0] * len(match) + [0.0] * (x.shape[0] - len(match))
        m = torch.stack([(rows[:, 0] * row_w).sum(), (rows[:, 1] * row_w).sum(), row_w.sum()])
        return (x * 0).sum(), m, rows

    monkeypatch.setattr(loss, "soft_ce", fake_soft_ce)  # what step_soft_ce calls
    head = build_head(HeadConfig(type="mtp", num_steps=2), parts)
    b = PackedBatch(torch.arange(6), torch.randn(6, 64), torch.ones(6, dtype=torch.bool), [6])
    _, stats = objective.head_objective(head, b)
    s = objective.summarize(stats)
    assert s["exp_accept_greedy"] == pytest.approx([0.75, 0.5])
    assert s["top1_acc"] == pytest.approx([0.75, 2 / 3])
    assert s["exp_tau_greedy"] == pytest.approx(2.125)
    a2 = (.5 * .4 + 1 * .5 + .2 * 1) / (.5 + 1 + .2)
    assert s["exp_accept_sampled_cond"] == pytest.approx([2.7 / 4, a2])
    assert s["exp_tau_sampled"] == pytest.approx(1 + 2.7 / 4 + 2.7 / 4 * a2)


def test_reduced_mtp_is_refused_by_the_deepseek_mtp_export(parts, tmp_path):
    from heads.formats import export_head

    head, _ = reduced_mtp(parts)
    save_head(head, tmp_path / "h")
    with pytest.raises(ValueError, match="reduced vocabulary of 40 tokens"):
        export_head(tmp_path / "h", "deepseek_mtp", tmp_path / "out", target_dir=tmp_path)
