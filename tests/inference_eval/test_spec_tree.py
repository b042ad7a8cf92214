"""Draft trees: EAGLE-2 construction, mask and verification vs per-sequence Python loops, greedy
equivalences, and statistical checks that tree verification emits the target distribution."""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from inference_eval.engine.sampling import SamplingParams, SamplingTensors, processed_probs
from inference_eval.engine.speculative.chain import verify_greedy
from inference_eval.engine.speculative.tree import (
    CHILD_MODES, DraftTree, build_tree, tree_attention_mask, tree_children, tree_emitted_tokens,
    tree_expand, tree_init, tree_positions, tree_prune, verify_tree_greedy, verify_tree_sampled)
from spec_stats import chi2_pvalue

V = 6
NEG_INF = float("-inf")


def first_argmax(row: torch.Tensor) -> int:
    vals = row.tolist()
    return vals.index(max(vals))


# --- a deterministic fake draft model: log-probs as a function of the token path -------------

def fake_logprobs(path: tuple[int, ...]) -> torch.Tensor:
    """[V] log-probs. Integer logits make ties common (tie-breaking gets exercised) and a few
    -inf entries mimic a top-k/top-p filtered draft (children can be missing)."""
    seed = 0
    for t in path:
        seed = (seed * 1_000_003 + t + 1) % (2**31 - 1)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (V,), generator=g).float()
    holes = torch.rand(V, generator=g) < 0.3
    holes[seed % V] = False
    return torch.log_softmax(logits.masked_fill(holes, NEG_INF), dim=-1)


def node_path(tokens: list[int], parents: list[int], node: int) -> tuple[int, ...]:
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return tuple(reversed(out))


def batched_draft(tree: DraftTree, frontier: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(*frontier.shape, V)  # empty slots: any finite row, it is ignored
    for b in range(frontier.shape[0]):
        toks, pars = tree.tokens[b].tolist(), tree.parents[b].tolist()
        for f, node in enumerate(frontier[b].tolist()):
            if node >= 0:
                out[b, f] = fake_logprobs(node_path(toks, pars, node))
    return out


def ref_build(root: int, depth: int, topk: int, frontier_size: int, total: int):
    """Per-sequence EAGLE-2 construction; returns [(token, parent, depth, score)] of kept nodes."""
    tok, par, dep, score = [root], [-1], [0], [torch.tensor(0.0)]
    frontier = [0]
    rank = lambda i: (-score[i].item(), i)
    for _ in range(depth):
        cands = []
        for node in frontier:
            lp = fake_logprobs(node_path(tok, par, node))
            for t in sorted(range(V), key=lambda t: (-lp[t].item(), t))[:topk]:
                if lp[t].item() == NEG_INF:
                    continue
                tok.append(t), par.append(node), dep.append(dep[node] + 1)
                score.append(score[node] + lp[t])  # fp32 add, as in the batched code
                cands.append(len(tok) - 1)
        frontier = sorted(cands, key=rank)[:frontier_size]
    kept = sorted(sorted(range(len(tok)), key=rank)[:total])
    new = {old: i for i, old in enumerate(kept)}
    return [(tok[i], new[par[i]] if par[i] >= 0 else -1, dep[i], score[i].item()) for i in kept]


def make_tree(b=5, depth=4, topk=3, frontier_size=3, total=12, seed=0) -> DraftTree:
    roots = torch.randint(0, V, (b,), generator=torch.Generator().manual_seed(seed))
    return build_tree(roots, batched_draft, depth, topk, frontier_size, total)


def tree_rows(tree: DraftTree, b: int):
    return [(int(tree.tokens[b, i]), int(tree.parents[b, i]), int(tree.depth[b, i]),
             float(tree.scores[b, i])) for i in range(tree.num_nodes) if tree.valid[b, i]]


def test_build_tree_matches_loop():
    for depth, topk, fs, total in [(4, 3, 3, 12), (3, 2, 4, 40), (5, 4, 2, 9), (2, 3, 3, 1)]:
        roots = torch.tensor([0, 1, 2, 3, 4, 5])
        tree = build_tree(roots, batched_draft, depth, topk, fs, total)
        assert tree.tokens.shape == (6, total)
        for b in range(6):
            assert tree_rows(tree, b) == ref_build(int(roots[b]), depth, topk, fs, total)
            n_valid = int(tree.valid[b].sum())
            assert bool(tree.valid[b, :n_valid].all())  # padding only at the end
            for i in range(1, n_valid):  # closed under parents, topologically ordered
                par = int(tree.parents[b, i])
                assert 0 <= par < i and int(tree.depth[b, i]) == int(tree.depth[b, par]) + 1
                assert float(tree.scores[b, i]) <= float(tree.scores[b, par])


def test_step_api_and_frontier():
    tree, frontier = tree_init(torch.tensor([3, 4]))
    tree, frontier = tree_expand(tree, frontier, batched_draft(tree, frontier), 3, 2)
    assert tree.num_nodes == 4 and frontier.shape == (2, 2)
    for b in range(2):  # the frontier holds the best-scored new nodes, best first
        s = tree.scores[b, frontier[b]]
        assert s[0] >= s[1] and float(s.max()) == float(tree.scores[b, 1:].max())
    pruned = tree_prune(tree, 6)
    assert pruned.num_nodes == 6 and not bool(pruned.valid[:, 4:].any())


def test_attention_mask_and_positions():
    tree = make_tree()
    mask = tree_attention_mask(tree.parents, tree.valid)
    for b in range(tree.batch_size):
        par, ok = tree.parents[b].tolist(), tree.valid[b].tolist()
        want = torch.zeros(tree.num_nodes, tree.num_nodes, dtype=torch.bool)
        for i in range(tree.num_nodes):
            j = i
            while j >= 0 and ok[i]:
                want[i, j], j = True, par[j]
            want[i, i] = True
        assert torch.equal(mask[b], want)
        assert torch.equal(tree_attention_mask(tree.parents[b], tree.valid[b]), want)
        assert torch.equal(mask[b].sum(-1)[tree.valid[b]], tree.depth[b][tree.valid[b]] + 1)
    start = torch.tensor([10, 20, 30, 40, 50])
    assert torch.equal(tree_positions(tree.depth, start), tree.depth + start[:, None])


def tree_target_logits(tree: DraftTree, seed: int) -> torch.Tensor:
    """[B, N, V] integer logits; at most nodes one child's token is made the clear argmax."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (tree.batch_size, tree.num_nodes, V), generator=g).float()
    kids = tree_children(tree.parents, tree.valid)
    for b in range(tree.batch_size):
        for i in range(tree.num_nodes):
            ks = [k for k in kids[b, i].tolist() if k >= 0]
            if ks and torch.rand(1, generator=g).item() < 0.75:
                logits[b, i, tree.tokens[b, ks[torch.randint(len(ks), (1,), generator=g)]]] = 5.0
    return logits


def ref_children(tree: DraftTree, b: int) -> dict[int, list[int]]:
    n = tree.num_nodes
    return {i: [j for j in range(n) if tree.valid[b, j] and int(tree.parents[b, j]) == i]
            for i in range(n)}


def pad(path: list[int], n: int) -> list[int]:
    return path + [-1] * (n - len(path))


def test_verify_tree_greedy_matches_loop():
    deep = 0
    for seed in range(6):
        tree = make_tree(seed=seed)
        logits = tree_target_logits(tree, seed)
        path, n_acc, bonus = verify_tree_greedy(tree, logits)
        assert path.shape == (tree.batch_size, tree.max_depth() + 1)
        for b in range(tree.batch_size):
            kids, cur, want = ref_children(tree, b), 0, [0]
            while True:
                t = first_argmax(logits[b, cur])
                nxt = [c for c in kids[cur] if int(tree.tokens[b, c]) == t]
                if not nxt:
                    break
                cur = nxt[0]
                want.append(cur)
            assert path[b].tolist() == pad(want, path.shape[1])
            assert int(n_acc[b]) == len(want) - 1 and int(bonus[b]) == t
        deep += int((n_acc >= 2).sum())
    assert deep > 0


def hand_tree() -> DraftTree:
    """Root 7 with children tokens 2, 2, 3 (nodes 1-3); node 2 has child 4 (node 4)."""
    return DraftTree(tokens=torch.tensor([[7, 2, 2, 3, 4]]),
                     parents=torch.tensor([[-1, 0, 0, 0, 2]]),
                     depth=torch.tensor([[0, 1, 1, 1, 2]]),
                     valid=torch.ones(1, 5, dtype=torch.bool), scores=torch.zeros(1, 5))


def test_duplicate_siblings_take_the_first():
    logits = torch.zeros(1, 5, V)
    logits[0, 0, 2] = logits[0, 1, 5] = logits[0, 2, 4] = 1.0
    path, n_acc, bonus = verify_tree_greedy(hand_tree(), logits)
    assert path.tolist() == [[0, 1, -1]] and n_acc.tolist() == [1] and bonus.tolist() == [5]
    emitted = tree_emitted_tokens(hand_tree(), path, n_acc, bonus)
    assert emitted.tolist() == [[2, 5, -1]]


def test_chain_shaped_tree_equals_chain_verifier():
    g = torch.Generator().manual_seed(1)
    b, k = 6, 4
    logits = torch.randint(0, 3, (b, k + 1, V), generator=g).float()
    draft = torch.where(torch.rand(b, k, generator=g) < 0.8, logits[:, :k].argmax(-1),
                        torch.randint(0, V, (b, k), generator=g))
    num_draft = torch.tensor([0, 1, 2, 3, 4, 4])
    idx = torch.arange(k + 1)
    tree = DraftTree(torch.cat([torch.zeros(b, 1, dtype=torch.long), draft], 1),
                     (idx - 1).expand(b, -1), idx.expand(b, -1), idx <= num_draft[:, None],
                     torch.zeros(b, k + 1))
    path, n_acc, bonus = verify_tree_greedy(tree, logits)
    acc, out = verify_greedy(draft, logits, num_draft)
    assert torch.equal(n_acc, acc)
    assert torch.equal(tree_emitted_tokens(tree, path, n_acc, bonus), out)


def ref_tree_sampled(tree, q, p, mode, seed):
    g = torch.Generator().manual_seed(seed)
    c = tree_children(tree.parents, tree.valid).shape[-1]
    u = torch.rand(tree.batch_size, tree.max_depth(), c, generator=g)
    u_final = torch.rand(tree.batch_size, 1, generator=g)
    paths, bonuses = [], []
    for b in range(tree.batch_size):
        kids, cur, path = ref_children(tree, b), 0, [0]
        pc, qc = p[b, 0], q[b, 0]
        for d in range(tree.max_depth()):
            nxt = None
            for j, child in enumerate(kids[cur]):
                x = int(tree.tokens[b, child])
                r = F.one_hot(torch.tensor(x), V).float() if mode == "topk" else qc
                px, rx = float(pc[x]), float(r[x])
                if (px > 0) if rx == 0 else float(u[b, d, j]) < min(1.0, px / rx):
                    nxt = child
                    break
                res = (pc - r).clamp_min(0)
                pc = res / res.sum() if float(res.sum()) > 0 else pc
                if mode == "without_replacement":
                    qc = qc.clone()
                    qc[x] = 0
                    qc = qc / qc.sum()
            if nxt is None:
                break
            cur = nxt
            path.append(cur)
            pc, qc = p[b, cur], q[b, cur]
        cdf = pc.cumsum(0)
        bonuses.append(min(int((cdf <= float(u_final[b]) * cdf[-1]).sum()), V - 1))
        paths.append(pad(path, tree.max_depth() + 1))
    return torch.tensor(paths), torch.tensor(bonuses)


def test_verify_tree_sampled_matches_loop():
    for seed, mode in enumerate(CHILD_MODES * 2):
        tree = make_tree(seed=seed)
        g = torch.Generator().manual_seed(50 + seed)
        noise = torch.randn(*tree.tokens.shape, V, generator=g)
        p = torch.softmax(tree_target_logits(tree, seed) + noise, -1)
        q = torch.softmax(torch.randn(*tree.tokens.shape, V, generator=g), -1)
        gen = torch.Generator().manual_seed(seed)
        path, n_acc, bonus = verify_tree_sampled(tree, q, p, gen, mode)
        ref_path, ref_bonus = ref_tree_sampled(tree, q, p, mode, seed)
        assert torch.equal(path, ref_path) and torch.equal(bonus, ref_bonus)
        assert torch.equal(n_acc, (path[:, 1:] >= 0).sum(1))


def test_one_hot_target_equals_greedy():
    for seed, mode in enumerate(CHILD_MODES * 2):
        tree = make_tree(seed=seed)
        logits = tree_target_logits(tree, seed)
        st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * logits[..., 0].numel())
        p = processed_probs(logits.view(-1, V), st).view(logits.shape)
        g = torch.Generator().manual_seed(seed)
        q = torch.softmax(torch.randn(logits.shape, generator=g), -1)
        got = verify_tree_sampled(tree, q, p, torch.Generator().manual_seed(seed), mode)
        for a, b in zip(got, verify_tree_greedy(tree, logits)):
            assert torch.equal(a, b)


# --- statistical losslessness: root with 3 children, each with 2 children, V = 5 -------------

@lru_cache(maxsize=None)  # each simulation is shared by the tests that read it
def simulate_tree(mode: str, verify_mode: str, n: int = 20_000, seed: int = 0):
    """n independent verifications of trees whose children are chosen as `mode` says, verified
    with `verify_mode`. The target and draft are tables over paths of length <= 2. Returns
    counts [25] of the first two emitted tokens (a fresh target sample completes rows that
    emitted one), the exact joint [25], the depth-1 acceptance rate and the trees' tokens."""
    v = 5
    g = torch.Generator().manual_seed(seed)
    shapes = [(v,), (v, v), (v, v, v)]
    P0, P1, P2 = (torch.softmax(torch.randn(*s, generator=g), -1) for s in shapes)
    Q0, Q1 = (torch.softmax(1.5 * torch.randn(*s, generator=g), -1) for s in [(v,), (v, v)])

    def pick(q: torch.Tensor, k: int) -> torch.Tensor:  # q [n, v] -> children tokens [n, k]
        if mode == "topk":
            return q.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        if mode == "iid":
            return torch.multinomial(q, k, replacement=True, generator=g)
        # Ordered sampling without replacement = top-k of log q + Gumbel noise.
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=g)))
        return (q.log() + gumbel).sort(-1, descending=True).indices[:, :k]

    t1 = pick(Q0.expand(n, v), 3)  # nodes 1..3
    t2 = pick(Q1[t1.flatten()], 2).reshape(n, 6)  # nodes 4..9: children of node 1 + i // 2
    par_tok = t1.repeat_interleave(2, dim=1)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), t1, t2], 1)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]).expand(n, -1)
    depth = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2, 2, 2]).expand(n, -1)
    valid = torch.ones(n, 10, dtype=torch.bool)
    tree = DraftTree(tokens, parents, depth, valid, torch.zeros(n, 10))
    p = torch.cat([P0.expand(n, 1, v), P1[t1], P2[par_tok, t2]], 1)
    q = torch.cat([Q0.expand(n, 1, v), Q1[t1], Q1[t2]], 1)  # rows 4..9 unused (leaves)
    path, n_acc, bonus = verify_tree_sampled(tree, q, p, g, verify_mode)
    out = tree_emitted_tokens(tree, path, n_acc, bonus)
    y0 = out[:, 0]
    y1 = torch.where(n_acc >= 1, out[:, 1], torch.multinomial(P1[y0], 1, generator=g).squeeze(1))
    counts = torch.bincount(y0 * v + y1, minlength=v * v)
    return counts, (P0[:, None] * P1).flatten(), float((n_acc >= 1).float().mean()), t1, P0


def test_tree_sampling_is_lossless():
    for mode in CHILD_MODES:
        counts, joint, _, _, _ = simulate_tree(mode, mode)
        # A fixed seed makes this deterministic; under exactness the p-value is uniform, so
        # 1e-4 rarely flags a correct rule while the biased rule below scores ~1e-100.
        assert chi2_pvalue(counts, joint) > 1e-4, mode


def test_topk_acceptance_is_optimal():
    # With deterministic children the best any lossless rule can do is emit a child with
    # the child's target probability: P(accept at depth 1) = P0(children).
    _, _, rate, t1, P0 = simulate_tree("topk", "topk")
    assert abs(rate - float(P0[t1[0]].sum())) < 0.01


def test_topk_rule_is_lossless_for_sampled_children_too():
    # It conditions on the children, so how they were chosen does not matter; it just accepts
    # less often than the q-rule made for those draws.
    counts, joint, rate, _, _ = simulate_tree("without_replacement", "topk")
    assert chi2_pvalue(counts, joint) > 1e-4
    assert rate < simulate_tree("without_replacement", "without_replacement")[2]


def test_wrong_rules_are_caught():
    # The classic mistake (top-k children verified as if drawn from q) and a subtle one
    # (children drawn without replacement verified as if iid): the statistic must see both.
    for mode, wrong_rule in [("topk", "without_replacement"), ("without_replacement", "iid")]:
        counts, joint, _, _, _ = simulate_tree(mode, wrong_rule)
        assert chi2_pvalue(counts, joint) < 1e-6, (mode, wrong_rule)


def test_top_children_equal_a_full_stable_sort_with_and_without_ties():
    from inference_eval.engine.speculative.tree import _top_children

    g = torch.Generator().manual_seed(3)
    for ties in (False, True):
        lp = torch.randn(3, 4, 50, generator=g)
        if ties:  # few distinct values: ties inside the top k and across its edge
            lp = (lp * 2).round() / 2
        for k in (1, 5, 50):
            vals, idx = _top_children(lp, k)
            ref_v, ref_i = lp.sort(dim=-1, descending=True, stable=True)
            assert torch.equal(idx, ref_i[..., :k]) and torch.equal(vals, ref_v[..., :k])
