"""Chain verification: batched functions vs a per-request Python loop, the greedy special case,
and a statistical check that speculative sampling emits the target distribution."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.sampling import SamplingParams, SamplingTensors, processed_probs
from inference_eval.engine.speculative.chain import residual_probs, verify_greedy, verify_sampled
from spec_stats import chi2_pvalue


def first_argmax(row: list[float]) -> int:
    return min(i for i, v in enumerate(row) if v == max(row))


def ref_verify_greedy(draft, logits, num_draft):
    out, acc = [], []
    for b in range(draft.shape[0]):
        toks, a = [], 0
        while a < int(num_draft[b]) and int(draft[b, a]) == first_argmax(logits[b, a].tolist()):
            toks.append(int(draft[b, a]))
            a += 1
        toks.append(first_argmax(logits[b, a].tolist()))
        acc.append(a)
        out.append(toks + [-1] * (draft.shape[1] + 1 - len(toks)))
    return torch.tensor(acc), torch.tensor(out)


def ref_inverse_cdf(probs: torch.Tensor, u: float) -> int:
    cdf = probs.cumsum(0)
    return min(int((cdf <= u * cdf[-1]).sum()), probs.shape[0] - 1)


def ref_verify_sampled(draft, q, p, num_draft, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(draft.shape, generator=g)  # same draws, same order as the batched function
    u_final = torch.rand(draft.shape[0], 1, generator=g)
    out, acc = [], []
    for b in range(draft.shape[0]):
        toks, a, final = [], 0, None
        while a < int(num_draft[b]):
            x = int(draft[b, a])
            if float(u[b, a]) < min(1.0, float(p[b, a, x]) / float(q[b, a, x])):
                toks.append(x)
                a += 1
            else:
                r = (p[b, a] - q[b, a]).clamp_min(0)
                final = r / r.sum() if float(r.sum()) > 0 else p[b, a]
                break
        final = p[b, a] if final is None else final
        toks.append(ref_inverse_cdf(final, float(u_final[b])))
        acc.append(a)
        out.append(toks + [-1] * (draft.shape[1] + 1 - len(toks)))
    return torch.tensor(acc), torch.tensor(out)


def random_case(seed: int, b: int = 8, k: int = 5, v: int = 7):
    """Integer logits (many ties) and drafts that copy the target's argmax most of the time."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (b, k + 1, v), generator=g).float()
    draft = logits[:, :k].argmax(-1)
    noise = torch.randint(0, v, (b, k), generator=g)
    draft = torch.where(torch.rand(b, k, generator=g) < 0.25, noise, draft)
    num_draft = torch.randint(0, k + 1, (b,), generator=g)
    num_draft[0], num_draft[1] = 0, k  # always cover both ends
    return draft, logits, num_draft


def test_verify_greedy_matches_loop():
    for seed in range(10):
        draft, logits, num_draft = random_case(seed)
        acc, out = verify_greedy(draft, logits, num_draft)
        ref_acc, ref_out = ref_verify_greedy(draft, logits, num_draft)
        assert torch.equal(acc, ref_acc) and torch.equal(out, ref_out)
        assert bool((acc <= num_draft).all())


def test_verify_greedy_ties_and_num_draft():
    # Row 0: the tie between ids 1 and 3 goes to 1, so draft 1 is accepted; row 1 proposed
    # nothing (num_draft 0) although its draft would match: only the target token is emitted.
    logits = torch.tensor([[[0., 5., 0., 5.], [9., 0., 0., 0.]]] * 2)
    draft = torch.tensor([[1], [1]])
    acc, out = verify_greedy(draft, logits, torch.tensor([1, 0]))
    assert acc.tolist() == [1, 0]
    assert out.tolist() == [[1, 0], [1, -1]]


def random_probs(g, *shape, sharp=1.0):
    return torch.softmax(sharp * torch.randn(*shape, generator=g), dim=-1)


def test_verify_sampled_matches_loop():
    b, k, v = 16, 4, 6
    for seed in range(6):
        g = torch.Generator().manual_seed(100 + seed)
        base = torch.randn(b, k + 1, v, generator=g)
        p = torch.softmax(base, -1)
        q = torch.softmax(base[:, :k] + 0.7 * torch.randn(b, k, v, generator=g), -1)
        draft = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(b, k)
        num_draft = torch.randint(0, k + 1, (b,), generator=g)
        acc, out = verify_sampled(draft, q, p, num_draft, torch.Generator().manual_seed(seed))
        ref_acc, ref_out = ref_verify_sampled(draft, q, p, num_draft, seed)
        assert torch.equal(acc, ref_acc) and torch.equal(out, ref_out)
        assert 0 < int(acc.sum()) < int(num_draft.sum())  # both branches exercised


def test_verify_sampled_one_hot_equals_greedy():
    # Greedy is sampling with one-hot p (processed_probs at temperature 0) and one-hot q.
    for seed in range(10):
        draft, logits, num_draft = random_case(seed)
        b, k1, v = logits.shape
        st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * (b * k1))
        p = processed_probs(logits.view(-1, v), st).view(b, k1, v)
        q = torch.nn.functional.one_hot(draft, v).float()
        got = verify_sampled(draft, q, p, num_draft, torch.Generator().manual_seed(seed))
        want = verify_greedy(draft, logits, num_draft)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_degenerate_residual():
    g = torch.Generator().manual_seed(0)
    p = random_probs(g, 4, 3, 5)
    assert torch.equal(residual_probs(p, p), p)  # p == q: fall back to p, never NaN
    draft = torch.multinomial(p[:, :2].reshape(-1, 5), 1, generator=g).view(4, 2)
    acc, out = verify_sampled(draft, p[:, :2], p, torch.full((4,), 2), g)
    assert acc.tolist() == [2, 2, 2, 2]  # q == p accepts every draft
    assert bool((out >= 0).all())


def simulate_chain(n: int, q_fix: torch.Tensor | None = None, seed: int = 0):
    """n trials of one verification with K = 2 over V = 4 and a target/draft whose row 1
    depends on the first token. Returns counts [V, V] of the first two emitted tokens
    (a fresh target sample completes rows that emitted one) and the exact joint."""
    v = 4
    g = torch.Generator().manual_seed(seed)
    p0, p1, p2 = random_probs(g, v), random_probs(g, v, v), random_probs(g, v, v)
    q0, q1 = random_probs(g, v, sharp=2.0), random_probs(g, v, v, sharp=2.0)
    x0 = torch.multinomial(q0, n, replacement=True, generator=g)
    x1 = torch.multinomial(q1[x0], 1, generator=g).squeeze(1)
    draft = torch.stack([x0, x1], 1)
    q = torch.stack([q0.expand(n, v), q1[x0]], 1) if q_fix is None else q_fix.expand(n, 2, v)
    p = torch.stack([p0.expand(n, v), p1[x0], p2[x1]], 1)
    num_draft = torch.randint(1, 3, (n,), generator=g)
    acc, out = verify_sampled(draft, q, p, num_draft, g)
    y0 = out[:, 0]
    y1 = torch.where(acc >= 1, out[:, 1], torch.multinomial(p1[y0], 1, generator=g).squeeze(1))
    counts = torch.bincount(y0 * v + y1, minlength=v * v)
    return counts, (p0.unsqueeze(1) * p1).flatten(), acc


def test_verify_sampled_is_lossless():
    counts, joint, acc = simulate_chain(40_000)
    assert chi2_pvalue(counts, joint) > 1e-4  # uniform under exactness; the control gets ~0
    assert 0.2 < float(acc.float().mean()) < 1.8  # drafts are neither always nor never taken


def test_lossless_test_has_power():
    # Claiming a uniform q for drafts really drawn from a sharp q0 biases the output; the
    # same statistic must notice.
    counts, joint, _ = simulate_chain(40_000, q_fix=torch.full((4,), 0.25))
    assert chi2_pvalue(counts, joint) < 1e-6


def test_chi2_leaves_out_impossible_cells_but_fails_a_draw_in_one():
    law = torch.tensor([[0.5, 0.0], [0.25, 0.25]])  # one cell the target never emits
    assert chi2_pvalue(torch.tensor([[50, 0], [25, 25]]), law) == pytest.approx(1.0)
    assert chi2_pvalue(torch.tensor([[70, 0], [15, 15]]), law) < 1e-3  # live cells still count
    with pytest.raises(AssertionError, match="1 draws fell in cells of target probability 0"):
        chi2_pvalue(torch.tensor([[50, 1], [25, 24]]), law)
