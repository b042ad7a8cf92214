"""The in-block transition bias of block drafters (head.markov_rank, heads/transition.py):
training's folded logits against a plain per-row loop that reads each row's previous data
token (DFlash rows and P-EAGLE steps), a head that starts as the same head without the bias,
gradients into both factors, checkpoints, and what is refused."""
from __future__ import annotations

import pytest
import torch

from heads.batch import PackedBatch
from heads.block_objective import block_labels, sample_anchors
from heads.checkpoint import load_head, save_head
from heads.config import HeadConfig
from heads.formats import export_head
from heads.registry import build_head
from heads.rollout import rollout

AUX = [0, 1, 2]
KINDS = {"dflash": dict(type="dflash", num_steps=3, num_layers=1),
         "peagle": dict(type="eagle3", num_steps=3, parallel_drafting=True),
         # d_1 biased from the block's anchor too (DSpark's convention)
         "dflash_first": dict(type="dflash", num_steps=3, num_layers=1, markov_first=True)}


def _batch(lens=(11, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return PackedBatch(torch.randint(0, 300, (n,), generator=g), torch.randn(n, 64, generator=g),
                       torch.rand(n, generator=g) > 0.2, list(lens), torch.randn(n, 3, 64, generator=g))


def _head(parts, kind, rank=4, seed=1, **kw):
    head = build_head(HeadConfig(**KINDS[kind], aux_layers=AUX, markov_rank=rank, **kw), parts,
                      seed=seed)
    with torch.no_grad():  # a trained-looking bias: W away from its zero start
        if head.transition is not None:
            head.transition.out.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return head.eval()


def _soft_ce(logits, y, head):
    """Σ over rows of CE(target law, softmax(logits)) over the head's vocabulary."""
    w_t = head.frozen.weight
    d2t = head.draft_to_target()
    if d2t is not None:
        w_t = w_t[d2t]
    p = torch.softmax((y @ w_t.t()).float(), -1)
    return -(p * torch.log_softmax(logits.float(), -1)).sum(-1)


def _bias(head, tok: torch.Tensor) -> torch.Tensor:
    """U[tok's row] @ W^T by a plain search of the draft vocabulary: tok [1] -> [1, V_draft],
    zero when tok is not one of its tokens."""
    t, d2t = head.transition, head.draft_to_target()
    if d2t is None or head.cfg.markov_first:  # U: a row per target token
        u = t.prev[tok]
    else:
        hit = (d2t == tok).nonzero().flatten()
        u = t.prev[hit] if hit.numel() else t.prev.new_zeros(1, t.prev.shape[1])
    return (u @ t.out.t()).float()


def _loop_losses(head, batch) -> list[float]:
    """Each position's mean CE computed row by row: logits = lm_head(features) plus, for
    rows/steps k >= 2 (every row with markov_first), U[prev] @ W^T with prev the data token
    just before the predicted one (row 1's: the anchor)."""
    y_all = head.frozen.norm(batch.hidden)
    out = []
    if head.drafting == "block":
        anchors = sample_anchors(batch, None)
        feats = head.train_blocks(batch.aux, batch.seq_lens, batch.input_ids, anchors)
        for k in range(1, 4):
            rows, valid = block_labels(batch, anchors, k)
            ce = []
            for j in valid.nonzero().flatten().tolist():
                g = int(anchors[j])
                z = head.logits(feats[j, k:k + 1]).float()
                if k > 1 or head.cfg.markov_first:  # x_{g+k-1}: the token before x_{g+k}
                    z = z + _bias(head, batch.input_ids[g + k - 1:g + k])
                ce.append(_soft_ce(z, y_all[g + k - 1:g + k], head))
            out.append(float(torch.cat(ce).mean()))
        return out
    for k, o in enumerate(rollout(head, batch), 1):
        ce = []
        for t in o.index.valid.nonzero().flatten().tolist():
            z = head.logits(o.features[t:t + 1]).float()
            if k > 1:  # x_{t+k}: the token before the predicted x_{t+k+1}
                z = z + _bias(head, batch.input_ids[t + k:t + k + 1])
            ce.append(_soft_ce(z, y_all[t + k:t + k + 1], head))
        out.append(float(torch.cat(ce).mean()))
    return out


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("kind", ["dflash", "peagle", "dflash_first"])
def test_folded_objective_equals_a_per_row_loop(parts, kind, reduced):
    vocab = dict(draft_vocab_size=120) if reduced else {}
    head = build_head(HeadConfig(**KINDS[kind], aux_layers=AUX, markov_rank=4, **vocab), parts,
                      draft_vocab=torch.arange(0, 240, 2) if reduced else None, seed=1).eval()
    with torch.no_grad():
        head.transition.out.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
        batch = _batch()
        _, stats = head(batch)
        want = _loop_losses(head, batch)
    assert stats[:, 0].tolist() == pytest.approx(want, rel=1e-4)
    # the bias is really in it: the same head without it gives other losses at k >= 2
    with torch.no_grad():
        head.transition.out.zero_()
        _, plain = head(batch)
    biased = (0, 1, 2) if head.cfg.markov_first else (1, 2)
    if not head.cfg.markov_first:
        assert plain[0, 0] == pytest.approx(float(stats[0, 0]), rel=1e-6)
    assert all(abs(float(plain[k, 0] - stats[k, 0])) > 1e-3 for k in biased)


@pytest.mark.parametrize("kind", ["dflash", "peagle"])
def test_a_new_head_is_the_head_without_the_bias(parts, kind):
    """W starts at zero and the bias draws last: a freshly built head has its plain twin's
    other weights and objective."""
    head = build_head(HeadConfig(**KINDS[kind], aux_layers=AUX, markov_rank=4), parts, seed=3).eval()
    plain = build_head(HeadConfig(**KINDS[kind], aux_layers=AUX), parts, seed=3).eval()
    mine = {k: v for k, v in head.state_dict().items() if not k.startswith("transition.")}
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in mine.items())  # same draws
    assert float(head.transition.out.detach().abs().sum()) == 0.0
    assert float(head.transition.prev.detach().std()) == pytest.approx(1.0, abs=0.1)
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(head(batch)[1], plain(batch)[1])


@pytest.mark.parametrize("kind", ["dflash", "peagle"])
def test_gradients_reach_both_factors_and_only_the_rows_read(parts, kind):
    head = _head(parts, kind).train()
    batch = _batch()
    torch.manual_seed(0)
    loss, _ = head(batch, naive=False)
    loss.backward()
    g_out, g_prev = head.transition.out.grad, head.transition.prev.grad
    assert g_out is not None and float(g_out.abs().sum()) > 0
    touched = (g_prev.abs().sum(-1) > 0).nonzero().flatten()
    assert touched.numel() > 0 and set(touched.tolist()) <= set(batch.input_ids.tolist())
    # the chunked objective's gradient is the naive full-logits one's
    head.zero_grad()
    torch.manual_seed(0)
    head(batch, naive=True)[0].backward()
    torch.testing.assert_close(head.transition.out.grad, g_out, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.transition.prev.grad, g_prev, rtol=1e-4, atol=1e-6)


def test_checkpoint_round_trip_keeps_the_bias(parts, tmp_path):
    head = _head(parts, "dflash")
    save_head(head, tmp_path / "d")
    back = load_head(tmp_path / "d", parts)
    assert back.cfg.markov_rank == 4
    torch.testing.assert_close(back.transition.out, head.transition.out)
    prev = torch.tensor([3, 250, 7])
    torch.testing.assert_close(back.transition(prev), head.transition(prev))


def _reduced(parts, kind, seed=1):
    head = build_head(HeadConfig(**KINDS[kind], aux_layers=AUX, markov_rank=4, draft_vocab_size=120),
                      parts, draft_vocab=torch.arange(0, 240, 2), seed=seed).eval()
    with torch.no_grad():
        head.transition.out.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return head


@pytest.mark.parametrize("kind", ["dflash", "peagle"])
def test_a_reduced_vocabulary_keeps_u_to_its_tokens(parts, kind):
    """U has a row per draft token only; a previous token outside the draft vocabulary gets
    no bias, and training never touches a row for it."""
    head = _reduced(parts, kind)
    assert tuple(head.transition.prev.shape) == (120, 4)
    with torch.no_grad():
        outside = torch.tensor([1, 241, 299])  # odd, or past the draft tokens
        assert float(head.transition(outside).abs().sum()) == 0.0
        inside = torch.tensor([0, 2, 238])
        assert float(head.transition(inside).abs().min(-1).values.sum()) > 0.0
    head.train()
    torch.manual_seed(0)
    head(_batch())[0].backward()
    touched = (head.transition.prev.grad.abs().sum(-1) > 0).nonzero().flatten()
    assert touched.numel() > 0
    read = set((torch.arange(0, 240, 2)[touched]).tolist())
    assert read <= set(_batch().input_ids.tolist())


def test_markov_first_keeps_a_row_of_u_for_every_target_token(parts):
    """With markov_first d_1's previous token is the block's anchor, which can be any target
    token: U has V rows (W keeps the draft vocabulary's), and a token outside the draft
    vocabulary is biased like any other."""
    head = _reduced(parts, "dflash_first")
    assert tuple(head.transition.prev.shape) == (parts.arch.vocab_size, 4)
    assert tuple(head.transition.out.shape) == (120, 4)
    with torch.no_grad():
        outside = torch.tensor([1, 241, 299])
        want = torch.cat([_bias(head, outside[i:i + 1]) for i in range(3)])
        torch.testing.assert_close(head.transition(outside), want)
        assert float(head.transition(outside).abs().min(-1).values.sum()) > 0.0


def test_a_head_saved_with_u_over_all_target_tokens_loads_as_the_same_drafter(parts, tmp_path):
    """Heads saved before U was cut to the draft vocabulary stored it [V, r]; its draft
    tokens' rows are the same bias."""
    from safetensors.torch import load_file, save_file

    head = _reduced(parts, "dflash")
    save_head(head, tmp_path / "d")
    file = tmp_path / "d" / "model.safetensors"
    state = load_file(str(file))
    full = torch.randn(parts.arch.vocab_size, 4)  # rows outside the draft vocabulary: unused
    full[torch.arange(0, 240, 2)] = state["transition.prev"]
    state["transition.prev"] = full
    save_file(state, str(file), metadata={"format": "specheads-head-v1"})
    back = load_head(tmp_path / "d", parts)
    prev = torch.tensor([0, 4, 238, 7])
    torch.testing.assert_close(back.transition(prev), head.transition(prev))
    torch.testing.assert_close(back.transition.prev, head.transition.prev)


def test_refusals(parts, tmp_path):
    for bad in (dict(type="eagle3"), dict(type="mtp"), dict(type="medusa")):
        with pytest.raises(ValueError, match="head.markov_rank=4"):
            HeadConfig(**bad, markov_rank=4)
    with pytest.raises(ValueError, match="head.markov_rank=-1"):
        HeadConfig(type="dflash", markov_rank=-1)
    with pytest.raises(ValueError, match="no second draft"):
        HeadConfig(type="dflash", num_steps=1, markov_rank=4)
    for bad in (dict(type="dflash", num_steps=3),
                dict(type="eagle3", num_steps=3, parallel_drafting=True, markov_rank=4)):
        with pytest.raises(ValueError, match="head.markov_first"):
            HeadConfig(**bad, markov_first=True)
    save_head(_head(parts, "peagle"), tmp_path / "p")
    with pytest.raises(ValueError, match="transition bias.*speculators"):
        export_head(tmp_path / "p", "speculators", tmp_path / "out")


def test_soft_ce_extra_columns_get_their_own_gradient():
    """w_extra: logits x[:, :H] @ w^T + x[:, H:] @ w_extra^T, as the full-logits reference of
    the concatenated weight; a frozen w gets no gradient, w_extra and x theirs."""
    from heads.loss import soft_ce, soft_ce_reference

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 12, generator=g, requires_grad=True)
    y, w, wt = torch.randn(9, 8, generator=g), torch.randn(30, 10, generator=g), torch.randn(30, 8, generator=g)
    e = torch.randn(30, 2, generator=g, requires_grad=True)
    rw = (torch.rand(9, generator=g) > 0.3).float()
    loss, _ = soft_ce(x, w, y, wt, rw, None, 1.0, 4, w_extra=e)
    loss.backward()
    gx, ge, x.grad, e.grad = x.grad, e.grad, None, None
    want = soft_ce_reference(x, w, y, wt, rw, w_extra=e)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ge, e.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
    assert w.grad is None
