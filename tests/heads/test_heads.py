"""Heads: forward/backward on a tiny target, the alignment table, chunked loss vs naive,
checkpoint round trip."""
from __future__ import annotations

import pytest
import torch

from heads.batch import PackedBatch
from heads.checkpoint import load_head, save_head
from heads.config import HeadConfig
from heads.objective import STATS
from heads.loss import soft_ce, soft_ce_reference
from heads.registry import build_head
from heads.rollout import rollout, step_indices


def _batch(lens=(9, 6), aux=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return PackedBatch(torch.randint(0, 300, (n,), generator=g), torch.randn(n, 64, generator=g),
                       torch.rand(n, generator=g) > 0.2, list(lens),
                       torch.randn(n, 3, 64, generator=g) if aux else None)


def test_alignment_table_on_packed_batch():
    # Two sequences: A = rows 0..4 (len 5), B = rows 5..7 (len 3); loss_mask 1 except row 6.
    ids = torch.arange(100, 108)
    mask = torch.ones(8, dtype=torch.bool)
    mask[6] = False
    b = PackedBatch(ids, torch.zeros(8, 4), mask, [5, 3])
    s1 = step_indices(b, 1)
    # step 1 at t: token x_{t+1}, label row t+1, valid iff t+2 in the same sequence and masked.
    assert s1.tokens[:4].tolist() == [101, 102, 103, 104]
    assert s1.label_rows[:4].tolist() == [1, 2, 3, 4]
    # A: t=3 would predict row 5, which is B's: invalid. B: t=5 predicts row 7 (valid);
    # t=6 would need row 8 (past B).
    assert s1.valid.tolist() == [True, True, True, False, False, True, False, False]
    s2 = step_indices(b, 2)
    assert s2.tokens[:3].tolist() == [102, 103, 104]
    assert s2.tokens[3].item() == 0 and s2.tokens[4].item() == 0  # past A's end: pad, never B's
    assert s2.valid.tolist() == [True, True, False, False, False, False, False, False]


def test_alignment_valid_respects_loss_mask_inside_sequence():
    ids = torch.arange(10)
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    b = PackedBatch(ids, torch.zeros(10, 4), mask, [10])
    s1 = step_indices(b, 1)
    # valid[t] = loss_mask[t + 2] and t + 2 < 10
    assert s1.valid.tolist() == [True, True, False, True, True, True, True, True, False, False]


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "eagle3", "medusa"])
def test_forward_backward_every_head(kind, parts):
    cfg = HeadConfig(type=kind, num_steps=3, aux_layers=[0, 1, 2] if kind == "eagle3" else [])
    head = build_head(cfg, parts)
    loss, stats = head(_batch())
    assert stats.shape == (3, STATS) and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    assert head.frozen.norm.weight.grad is None  # frozen stays frozen


def test_chunked_loss_equals_naive_values_and_grads():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randn(37, 16, generator=g)
    wt = torch.randn(50, 16, generator=g)
    rw = (torch.rand(37, generator=g) > 0.3).float() * 0.7
    t2d = torch.tensor([1, 4, 9, 20, 33, 41, 49])
    for sub in (None, t2d):
        w_use = w if sub is None else w[:7]
        ref = soft_ce_reference(x, w_use, y, wt, rw, sub, temperature=1.3)
        gx_ref, gw_ref = torch.autograd.grad(ref, [x, w])
        got, _ = soft_ce(x, w_use, y, wt, rw, sub, temperature=1.3, chunk=5)
        gx, gw = torch.autograd.grad(got, [x, w])
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-6)


def test_rollout_never_reads_across_sequences(parts):
    """Changing sequence B must not change any of A's step outputs."""
    head = build_head(HeadConfig(type="mtp", num_steps=3), parts)
    b1 = _batch((7, 5), aux=False, seed=4)
    b2 = _batch((7, 5), aux=False, seed=4)
    b2.input_ids[7:] = (b2.input_ids[7:] + 13) % 300
    b2.hidden[7:] += 1.0
    with torch.no_grad():
        o1, o2 = rollout(head, b1), rollout(head, b2)
    for a, b in zip(o1, o2):
        torch.testing.assert_close(a.features[:7], b.features[:7])
        assert not torch.allclose(a.features[7:], b.features[7:])


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_checkpoint_round_trip_gives_identical_logits(kind, parts, tmp_path):
    cfg = HeadConfig(type=kind, num_steps=2, aux_layers=[0, 1, 2] if kind == "eagle3" else [],
                     draft_vocab_size=40 if kind == "eagle3" else None)
    vocab = torch.arange(0, 200, 5) if kind == "eagle3" else None
    head = build_head(cfg, parts, draft_vocab=vocab, seed=7)
    save_head(head, tmp_path / "h")
    back = load_head(tmp_path / "h", parts)
    b = _batch()
    with torch.no_grad():
        for o1, o2 in zip(rollout(head, b), rollout(back, b)):
            torch.testing.assert_close(head.logits(o1.features), back.logits(o2.features), rtol=0, atol=0)
    with pytest.raises(ValueError, match="medusa"):
        load_head(tmp_path / "h", parts, expect_type="medusa")


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "eagle3", "medusa"])
def test_every_head_takes_the_one_step_signature(kind, parts):
    """step(tokens, hidden_in, ctx, k=k), as the rollout and the engine's drafters call it;
    Medusa ignores tokens and ctx and hands step k+1 the same base feature."""
    cfg = HeadConfig(type=kind, num_steps=2, aux_layers=[0, 1, 2] if kind == "eagle3" else [])
    head = build_head(cfg, parts, seed=2)
    b = _batch((6,), aux=True, seed=3)
    with torch.no_grad():
        if not head.attends:  # zero-initialized blocks would make every Medusa head the same
            for p in head.blocks.parameters():
                p.normal_(0.0, 0.1)
        outs = rollout(head, b)
        assert len(outs) == 2 and all(o.features.shape == (6, 64) for o in outs)
        if head.attends:
            return
        hidden = head.first_hidden(b.hidden, b.aux)
        for k, out in enumerate(outs, 1):
            nxt, feats = head.step(None, hidden, None, k=k)
            torch.testing.assert_close(nxt, hidden, rtol=0, atol=0)
            torch.testing.assert_close(out.features, feats, rtol=0, atol=0)
        assert not torch.equal(outs[0].features, outs[1].features)
        with pytest.raises(ValueError, match="num_steps"):
            head.step(None, hidden, None, k=3)


def test_medusa_starts_as_the_target_and_eagle3_draft_lm_head_as_its_rows(parts):
    medusa = build_head(HeadConfig(type="medusa", num_steps=2), parts)
    assert all(torch.count_nonzero(p) == 0 for p in medusa.blocks.parameters())
    vocab = torch.arange(0, 200, 5)
    e3 = build_head(HeadConfig(type="eagle3", aux_layers=[0, 1, 2], draft_vocab_size=40), parts,
                    draft_vocab=vocab)
    torch.testing.assert_close(e3.draft_lm_head.detach(), parts.lm_head[vocab], rtol=0, atol=0)


def test_checkpoint_written_with_the_old_temperature_key_loads(parts, tmp_path):
    """head.temperature was renamed head.distill_temperature; older checkpoints still load."""
    import json

    head = build_head(HeadConfig(type="mtp", distill_temperature=0.5), parts, seed=1)
    save_head(head, tmp_path / "h")
    p = tmp_path / "h" / "config.json"
    meta = json.loads(p.read_text())
    meta["head"]["temperature"] = meta["head"].pop("distill_temperature")
    p.write_text(json.dumps(meta))
    assert load_head(tmp_path / "h", parts).cfg.distill_temperature == 0.5
    with pytest.raises(TypeError, match="temperature"):
        HeadConfig(temperature=0.5)
    with pytest.raises(ValueError, match="head.distill_temperature"):
        HeadConfig(distill_temperature=0.0)
    with pytest.raises(ValueError, match="head.feature_loss_weight"):
        HeadConfig(type="medusa", feature_loss_weight=1.0)


def test_hidden_noise_perturbs_training_steps_only(parts):
    """head.hidden_noise adds noise to the normed hidden input in training; the engine (eval
    mode) sees the noiseless head, and the noise reaches the loss."""
    with pytest.raises(ValueError, match="hidden_noise"):
        HeadConfig(type="mtp", hidden_noise=-0.1)
    batch = _batch(aux=False)
    plain = build_head(HeadConfig(type="mtp"), parts, seed=0)
    noisy = build_head(HeadConfig(type="mtp", hidden_noise=0.5), parts, seed=0)
    tokens, hidden = batch.input_ids[:4], batch.hidden[:4]
    plain.eval(), noisy.eval()
    with torch.no_grad():
        a, _ = plain.step(tokens, hidden, _ctx(plain, 4), k=1)
        b, _ = noisy.step(tokens, hidden, _ctx(noisy, 4), k=1)
    torch.testing.assert_close(a, b)  # same seed, same weights, no noise outside training
    plain.train(), noisy.train()
    torch.manual_seed(1)
    loss_plain, _ = plain(batch)
    torch.manual_seed(1)
    loss_noisy, _ = noisy(batch)
    assert not torch.allclose(loss_plain, loss_noisy)


def _ctx(head, t):
    """A cacheless causal step over t tokens for `head`'s layer."""
    from inference_eval.engine.attention import BatchLayout
    from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
    from inference_eval.engine.model.transformer import StepContext

    plan = TorchAttentionBackend().plan(BatchLayout.packed([t]))
    return StepContext(head.rope_cos[plan.positions], head.rope_sin[plan.positions], plan, None)
