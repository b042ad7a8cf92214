"""DFlash heads: the block attention mask (bidirectional inside a block, causal to the context)
against a plain per-block loop, the block alignment table on a packed batch, the training
objective (per-position weights, D-PACE against a loop, gradients), P-EAGLE's mask steps,
and the configs."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from heads.batch import PackedBatch
from heads.block_attention import BlockPlan, block_attention_mask
from heads.block_objective import anchor_candidates, block_labels, dpace_weights, sample_anchors
from heads.checkpoint import load_head, save_head
from heads.config import HeadConfig
from heads.objective import STATS
from heads.registry import build_head
from heads.rollout import rollout


def _batch(lens=(11, 7), seed=0, mask_p=0.2):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return PackedBatch(torch.randint(0, 300, (n,), generator=g), torch.randn(n, 64, generator=g),
                       torch.rand(n, generator=g) > mask_p, list(lens),
                       torch.randn(n, 3, 64, generator=g))


def _dflash(parts, steps=3, layers=2, seed=1, **kw):
    head = build_head(HeadConfig(type="dflash", num_steps=steps, num_layers=layers,
                                 aux_layers=[0, 1, 2], **kw), parts, seed=seed)
    with torch.no_grad():  # trained-looking norms: outputs that depend on every input
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return head


def test_block_mask_worked_example():
    """The table of heads/block_attention.py: 5 tokens, B = 3, anchors 1 and 3."""
    m = block_attention_mask([5], [[1, 3]], 3)[0]  # [6, 5 + 6]
    ctx, blk = m[:, :5], m[:, 5:]
    assert ctx.tolist() == [[True, False, False, False, False]] * 3 + [[True, True, True, False, False]] * 3
    want = torch.zeros(6, 6, dtype=torch.bool)
    want[:3, :3] = want[3:, 3:] = True
    assert torch.equal(blk, want)


def test_block_attention_equals_a_per_block_loop():
    """Two packed sequences, several blocks each, GQA: the masked batched attention equals,
    block by block, plain unmasked attention over [context before the anchor ; the block]."""
    g = torch.Generator().manual_seed(0)
    lens, b, heads, kvh, d = [9, 6], 3, 4, 2, 8
    anchors = torch.tensor([0, 4, 7, 9 + 2, 9 + 5])
    plan = BlockPlan(lens, anchors, b)
    j = anchors.numel()
    q = torch.randn(j * b, heads, d, generator=g)
    k, v = torch.randn(j * b, kvh, d, generator=g), torch.randn(j * b, kvh, d, generator=g)
    ck, cv = torch.randn(15, kvh, d, generator=g), torch.randn(15, kvh, d, generator=g)
    got = plan.attend(q, k, v, ck, cv)
    starts = [0, 9]
    for i, a in enumerate(anchors.tolist()):
        s = 0 if a < 9 else 1
        rows = slice(i * b, (i + 1) * b)
        keys = torch.cat([ck[starts[s]:a], k[rows]])  # context strictly before the anchor
        vals = torch.cat([cv[starts[s]:a], v[rows]])
        ref = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1).repeat_interleave(heads // kvh, 0),
            vals.transpose(0, 1).repeat_interleave(heads // kvh, 0)).transpose(0, 1)
        torch.testing.assert_close(got[rows], ref, rtol=1e-5, atol=1e-6, msg=f"block {i}")
    assert plan.positions.tolist() == [p for a in [0, 4, 7, 2, 5] for p in range(a, a + b)]


def test_train_blocks_equal_one_block_on_its_prefix_alone(parts):
    """A block of a packed batch reads nothing after its anchor, nothing of another block or
    sequence: it equals the same block computed on its own sequence's prefix x_0..x_a."""
    head = _dflash(parts).eval()
    batch = _batch()
    anchors = torch.tensor([0, 3, 8, 11 + 1, 11 + 4])
    with torch.no_grad():
        feats = head.train_blocks(batch.aux, batch.seq_lens, batch.input_ids, anchors)
        for i, a in enumerate(anchors.tolist()):
            start = 0 if a < 11 else 11
            sl = slice(start, a + 1)
            alone = head.train_blocks(batch.aux[sl], [a + 1 - start], batch.input_ids[sl],
                                      torch.tensor([a - start]))
            torch.testing.assert_close(feats[i], alone[0], rtol=1e-5, atol=1e-5, msg=f"anchor {a}")


def test_block_alignment_table_on_a_packed_batch():
    """Rows k = 1..K of the block at g: label row g+k-1 (p_{g+k-1}), valid iff g+k lies in
    g's sequence and loss_mask[g+k]; anchors need their first label."""
    ids = torch.arange(100, 108)
    mask = torch.ones(8, dtype=torch.bool)
    mask[6] = False
    b = PackedBatch(ids, torch.zeros(8, 4), mask, [5, 3])  # A = rows 0..4, B = rows 5..7
    # a + 1 < n and loss_mask[a + 1]: A's 0..3; B's 5 would need row 6 (not a label).
    assert anchor_candidates(b).tolist() == [True, True, True, True, False, False, True, False]
    anchors = torch.tensor([0, 3, 6])
    rows1, valid1 = block_labels(b, anchors, 1)
    assert rows1.tolist() == [0, 3, 6] and valid1.tolist() == [True, True, True]
    rows2, valid2 = block_labels(b, anchors, 2)
    # 0 -> row 2 valid; 3 -> row 5 is B's (invalid); 6 -> row 8 is past B.
    assert rows2.tolist() == [1, 4, 7] and valid2.tolist() == [True, False, False]
    torch.manual_seed(0)
    assert sample_anchors(b, None).tolist() == [0, 1, 2, 3, 6]
    picked = sample_anchors(b, 2).tolist()
    assert len(picked) == 3 and picked == sorted(picked) and 6 in picked


def test_dpace_weights_against_a_loop():
    g = torch.Generator().manual_seed(4)
    ce = torch.rand(5, 4, generator=g) * 3
    valid = torch.rand(5, 4, generator=g) > 0.3
    alpha = 0.4
    got = dpace_weights(ce, valid, alpha)
    for j in range(5):
        s = [(1 - alpha) * math.exp(-float(ce[j, i])) + alpha if valid[j, i] else 1.0 for i in range(4)]
        prefix = [math.prod(s[:i + 1]) for i in range(4)]
        for k in range(4):
            want = sum(prefix[i] for i in range(k, 4) if valid[j, i]) if valid[j, k] else 0.0
            assert float(got[j, k]) == pytest.approx(want, rel=1e-5), (j, k)


@pytest.mark.parametrize("weights", ["decay", "dpace"])
def test_objective_trains_every_weight_and_reports_chain_stats(parts, weights):
    head = _dflash(parts, position_weights=weights)
    batch = _batch()
    torch.manual_seed(0)
    loss, stats = head(batch)
    assert stats.shape == (3, STATS) and torch.isfinite(loss)
    loss.backward()
    lost = [n for n, p in head.named_parameters() if p.requires_grad and p.grad is None]
    assert not lost
    head.eval()  # every anchor: deterministic, rows = valid labels per position
    with torch.no_grad():
        _, s1 = head(batch)
        _, s2 = head(batch)
    assert torch.equal(s1, s2)
    anchors = sample_anchors(batch, None)
    assert s1[:, 3].tolist() == [float(block_labels(batch, anchors, k)[1].sum()) for k in (1, 2, 3)]
    naive_loss, naive_stats = head(batch, naive=True)
    torch.testing.assert_close(naive_loss, head(batch)[0], rtol=1e-4, atol=1e-5)


def test_decay_weights_are_dflash_exponential(parts):
    """loss = Σ_k exp(-(k-1)/γ) loss_k with the stats' per-position losses."""
    head = _dflash(parts, decay_gamma=2.0).eval()
    with torch.no_grad():
        loss, stats = head(_batch())
    want = sum(math.exp(-(k - 1) / 2.0) * float(stats[k - 1, 0]) for k in (1, 2, 3))
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_a_batch_without_labels_still_reaches_every_weight(parts):
    head = _dflash(parts)
    b = _batch(mask_p=1.1)  # no loss-masked token anywhere
    loss, stats = head(b)
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(stats[:, 3].sum()) == 0.0
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)


def test_checkpoint_round_trip(parts, tmp_path):
    head = _dflash(parts, mask_token_id=7, draft_vocab_size=None)
    save_head(head, tmp_path / "d")
    back = load_head(tmp_path / "d", parts)
    assert back.cfg == head.cfg and back.mask_id == 7 and back.arch.num_layers == 2
    b = _batch()
    anchors = sample_anchors(b, None)
    with torch.no_grad():
        torch.testing.assert_close(back.train_blocks(b.aux, b.seq_lens, b.input_ids, anchors),
                                   head.train_blocks(b.aux, b.seq_lens, b.input_ids, anchors))


def test_peagle_steps_read_the_mask_not_the_chain(parts):
    """P-EAGLE: steps >= 2 do not depend on the tokens or on the previous step's output, only
    (through attention) on the earlier steps at the same position; step 1 is EAGLE-3's."""
    cfg = HeadConfig(type="eagle3", num_steps=3, aux_layers=[0, 1, 2], parallel_drafting=True)
    head = build_head(cfg, parts, seed=2).eval()
    plain = build_head(HeadConfig(type="eagle3", num_steps=3, aux_layers=[0, 1, 2]), parts, seed=2).eval()
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if k != "mask_hidden"}, strict=False)
    b = _batch()
    other = PackedBatch(torch.randint(0, 300, b.input_ids.shape), b.hidden, b.loss_mask, b.seq_lens, b.aux)
    other.input_ids[:2] = b.input_ids[:2]
    with torch.no_grad():
        o1, o2, op = rollout(head, b), rollout(head, other), rollout(plain, b)
    torch.testing.assert_close(o1[0].features, op[0].features)  # step 1: EAGLE-3 itself
    assert not torch.allclose(o1[1].features, op[1].features)
    # Position 0's steps 2, 3 read only x_1 (step 1, kept equal) and the mask.
    for k in (1, 2):
        torch.testing.assert_close(o1[k].features[0], o2[k].features[0])
    assert "mask_hidden" in head.trainable_state() and head.drafting == "parallel"


def test_config_refusals(parts):
    with pytest.raises(ValueError, match="head.parallel_drafting"):
        HeadConfig(type="mtp", parallel_drafting=True)
    with pytest.raises(ValueError, match="head.num_layers"):
        HeadConfig(type="mtp", num_layers=2)
    with pytest.raises(ValueError, match="head.position_weights"):
        HeadConfig(type="dflash", position_weights="flat")
    with pytest.raises(ValueError, match="auxiliary layers"):
        build_head(HeadConfig(type="dflash"), parts)
    with pytest.raises(ValueError, match="mask_token_id=300"):
        build_head(HeadConfig(type="dflash", aux_layers=[0, 1], mask_token_id=300), parts)
    head = _dflash(parts)
    assert head.mask_id == 299 and head.block_size == 4 and head.drafting == "block"
    with pytest.raises(TypeError, match="blocks"):
        head.step(None, None, None)
