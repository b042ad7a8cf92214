"""EAGLE-2 dynamic draft trees: construction, attention mask, positions and verification.

A batch of trees is a `DraftTree` of [B, N] tensors. Node 0 is the root (the last accepted
token, already in the KV cache's prefix); every other node is a draft token whose parent has a
smaller index, so node order is a topological order and a prefix of the nodes is a tree.

Construction, depth by depth, as the engine runs it (EAGLE-2, Li et al. 2024):

    tree, frontier = tree_init(root_tokens)               # frontier [B, 1] = the root
    for _ in range(depth):
        logprobs = draft(tree, frontier)                  # [B, F, V] at the frontier nodes
        tree, frontier = tree_expand(tree, frontier, logprobs, topk, frontier_size)
    tree = tree_prune(tree, total_tokens)                 # [B, total_tokens]

Every expansion adds the top-k children of each frontier node (all of them become nodes) and
keeps the `frontier_size` best new nodes by cumulative draft log-prob for the next depth; the
final prune keeps the `total_tokens` best nodes overall. Ties break by node index (and children
of one parent by token id), so the result is deterministic.

Verification walks from the root: `verify_tree_greedy` follows the target's argmax,
`verify_tree_sampled` runs recursive rejection sampling over each node's children (see its
docstring for the rule and why it is lossless).

Padding convention: invalid nodes have token 0 (safe for an embedding lookup), parent -1,
depth 0, score -inf; frontier slots are -1 when empty. `valid == (scores > -inf)` throughout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from inference_eval.engine.sampling import sample_from_probs
from inference_eval.engine.speculative.chain import accept_mask, residual_probs

CHILD_MODES = ("topk", "iid", "without_replacement")
TREE_FIELDS = ("tokens", "parents", "depth", "valid", "scores")


@dataclass
class DraftTree:
    """tokens [B, N] int64, parents [B, N] int64 (-1: root/invalid), depth [B, N] int64
    (root 0), valid [B, N] bool, scores [B, N] fp32 (sum of draft log-probs along the path)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def max_depth(self) -> int:
        """Deepest valid node over the batch (0 for root-only trees)."""
        return int(torch.where(self.valid, self.depth, 0).max()) if self.num_nodes else 0

    def gather(self, idx: torch.Tensor) -> "DraftTree":
        """Nodes idx [B, M] (-1 = empty slot) -> a [B, M] tree; parents are NOT remapped."""
        safe, ok = idx.clamp(min=0), idx >= 0
        def pick(t: torch.Tensor, fill) -> torch.Tensor:
            return torch.where(ok, t.gather(1, safe), torch.full_like(safe, fill, dtype=t.dtype))

        return DraftTree(pick(self.tokens, 0), pick(self.parents, -1), pick(self.depth, 0),
                         pick(self.valid, False), pick(self.scores, float("-inf")))


def _cat(a: DraftTree, b: DraftTree) -> DraftTree:
    return DraftTree(*(torch.cat([getattr(a, f), getattr(b, f)], dim=1) for f in TREE_FIELDS))


def _rank_desc(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices [B, keep] of the best scores, highest first, ties to the lower index; slots past
    the last finite score are -1. scores [B, M]."""
    order = scores.sort(dim=1, descending=True, stable=True).indices[:, :keep]
    order = torch.where(scores.gather(1, order) > float("-inf"), order, torch.full_like(order, -1))
    if order.shape[1] < keep:
        order = torch.cat([order, order.new_full((order.shape[0], keep - order.shape[1]), -1)], 1)
    return order


def _top_children(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best entries of logprobs [..., V] by (value desc, token id asc) -> ([..., k],
    [..., k]). topk plus a re-sort of the k winners; a full stable sort only when a tie
    straddles the k-th place (topk would pick an arbitrary one of the tied ids)."""
    vals, idx = logprobs.topk(k, dim=-1)
    if bool(((logprobs >= vals[..., -1:]).sum(-1) > k).any()):
        vals, idx = logprobs.sort(dim=-1, descending=True, stable=True)
        return vals[..., :k], idx[..., :k]
    idx = idx.sort(dim=-1).values  # id order, then a stable sort by value keeps it on ties
    vals = logprobs.gather(-1, idx)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return vals, idx.gather(-1, order)


def tree_init(root_tokens: torch.Tensor) -> tuple[DraftTree, torch.Tensor]:
    """root_tokens [B] int64 -> (a one-node tree per row, frontier [B, 1] = node 0)."""
    b, dev = root_tokens.shape[0], root_tokens.device
    zeros = torch.zeros(b, 1, dtype=torch.long, device=dev)
    tree = DraftTree(root_tokens.long().view(b, 1), zeros - 1, zeros.clone(),
                     torch.ones(b, 1, dtype=torch.bool, device=dev),
                     torch.zeros(b, 1, dtype=torch.float32, device=dev))
    return tree, zeros


def tree_expand(tree: DraftTree, frontier: torch.Tensor, child_logprobs: torch.Tensor,
                topk: int, frontier_size: int) -> tuple[DraftTree, torch.Tensor]:
    """Grow one depth.

    tree [B, N], frontier [B, F] int64 node indices (-1 = empty), child_logprobs [B, F, V]
    (the draft's log-softmax at each frontier node; rows of empty slots are ignored) ->
    (tree [B, N + F*topk], new frontier [B, frontier_size]).

    New node N + f*topk + j is the j-th most likely child of frontier slot f (token-id order on
    ties). Children with log-prob -inf (filtered out of the draft distribution) are invalid.
    """
    b, f = frontier.shape
    n = tree.num_nodes
    if child_logprobs.shape[:2] != (b, f):
        raise ValueError(f"child_logprobs must be [B, F, V] = [{b}, {f}, V], "
                         f"got {tuple(child_logprobs.shape)}")
    k = min(topk, child_logprobs.shape[-1])
    lp, tok = _top_children(child_logprobs.float(), k)  # [B, F, k]
    parent = tree.gather(frontier)  # [B, F]
    ok = (parent.valid.unsqueeze(-1) & (lp > float("-inf"))).reshape(b, f * k)
    # Cumulative log-prob = log of the product of draft probs along the path (EAGLE-2's
    # "global acceptance" proxy). lp <= 0, so a child never outranks its parent.
    score = (parent.scores.unsqueeze(-1) + lp).reshape(b, f * k)

    def per_child(t: torch.Tensor) -> torch.Tensor:  # [B, F] -> [B, F*k], slot-major
        return t.unsqueeze(-1).expand(b, f, k).reshape(b, f * k)

    kids = DraftTree(
        tokens=torch.where(ok, tok.reshape(b, f * k), 0),
        parents=torch.where(ok, per_child(frontier), -1),
        depth=torch.where(ok, per_child(parent.depth + 1), 0),
        valid=ok,
        scores=torch.where(ok, score, float("-inf")),
    )
    order = _rank_desc(kids.scores, frontier_size)
    new_frontier = torch.where(order >= 0, order + n, -1)
    return _cat(tree, kids), new_frontier


def tree_prune(tree: DraftTree, total_tokens: int) -> DraftTree:
    """Keep the best `total_tokens` nodes (root included) -> tree [B, total_tokens].

    Ranking by (score desc, index asc) keeps the kept set closed under parents: a child's score
    is <= its parent's (log-probs are <= 0 and float addition of a non-positive number never
    increases) and on a tie the parent's smaller index wins, so a parent always ranks before
    its children. The root (score 0, index 0) always ranks first. Kept nodes stay in their
    original relative order, so parents still precede children; short rows are padded.
    """
    b, n = tree.tokens.shape
    top = _rank_desc(tree.scores, total_tokens)  # [B, total_tokens], -1 padded
    keep = torch.zeros(b, n + 1, dtype=torch.bool, device=top.device)
    keep.scatter_(1, torch.where(top >= 0, top, n), True)
    keep = keep[:, :n]
    idx = torch.arange(n, device=top.device).expand(b, n)
    kept = torch.where(keep, idx, n + idx).sort(dim=1).values[:, :total_tokens]
    kept = torch.where(kept < n, kept, -1)
    if kept.shape[1] < total_tokens:
        kept = torch.cat([kept, kept.new_full((b, total_tokens - kept.shape[1]), -1)], dim=1)
    new_index = keep.long().cumsum(dim=1) - 1  # old index -> new index (for kept nodes)
    out = tree.gather(kept)
    out.parents = torch.where(out.parents >= 0, new_index.gather(1, out.parents.clamp(min=0)), -1)
    return out


def tree_limit(tree: DraftTree, max_depth: torch.Tensor) -> DraftTree:
    """Drop nodes deeper than max_depth [B] (per request: near max_new_tokens or the context
    end) and compact -> tree [B, N] whose valid nodes are a prefix of each row. Closed under
    parents (an ancestor is never deeper), so the result is still a tree."""
    keep = tree.valid & (tree.depth <= max_depth.view(-1, 1))
    cut = DraftTree(tree.tokens, tree.parents, tree.depth, keep,
                    torch.where(keep, tree.scores, float("-inf")))
    return tree_prune(cut, tree.num_nodes)


def build_tree(root_tokens: torch.Tensor,
               draft: Callable[[DraftTree, torch.Tensor], torch.Tensor],
               depth: int, topk: int, frontier_size: int, total_tokens: int) -> DraftTree:
    """The whole EAGLE-2 construction. draft(tree, frontier [B, F]) -> log-probs [B, F, V].
    root_tokens [B] -> tree [B, total_tokens]."""
    tree, frontier = tree_init(root_tokens)
    for _ in range(depth):
        tree, frontier = tree_expand(tree, frontier, draft(tree, frontier), topk, frontier_size)
    return tree_prune(tree, total_tokens)


def tree_children(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Children table: parents, valid [B, N] -> [B, N, C] int64 child indices in node order,
    -1 padded, C = the most children any node has (0 if no node has one)."""
    b, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    # is_child[b, i, j]: node j is a child of node i.
    is_child = (parents.unsqueeze(1) == idx.view(1, n, 1)) & valid.unsqueeze(1)
    c = int(is_child.sum(dim=-1).max()) if n else 0
    # A child's slot is its rank among its siblings; non-children all land in spare slot c.
    slot = torch.where(is_child, is_child.long().cumsum(dim=-1) - 1, c)
    table = torch.full((b, n, c + 1), -1, dtype=torch.long, device=parents.device)
    return table.scatter_(2, slot, idx.expand(b, n, n).contiguous())[..., :c]


def tree_attention_mask(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """parents, valid [N] or [B, N] -> bool [N, N] or [B, N, N]: mask[i, j] iff node j is node i
    or an ancestor of i, both valid. An invalid node's row holds only its diagonal, so an
    attention kernel never sees an empty row (and no valid node ever sees an invalid one)."""
    single = parents.dim() == 1
    if single:
        parents, valid = parents.unsqueeze(0), valid.unsqueeze(0)
    n = parents.shape[1]
    cols = torch.arange(n, device=parents.device)
    anc = cols.expand_as(parents).clone()  # walk every node up its ancestor chain at once
    mask = torch.zeros(parents.shape[0], n, n, dtype=torch.bool, device=parents.device)
    while bool((anc >= 0).any()):
        mask |= anc.unsqueeze(-1) == cols
        anc = torch.where(anc >= 0, parents.gather(1, anc.clamp(min=0)), -1)
    both = valid.unsqueeze(-1) & valid.unsqueeze(-2)
    mask = (mask & both) | torch.eye(n, dtype=torch.bool, device=parents.device)
    return mask[0] if single else mask


def tree_positions(depth: torch.Tensor, start: torch.Tensor | int = 0) -> torch.Tensor:
    """Rotary positions of the nodes: depth [B, N] (or [N]) + start ([B] position of the root,
    or an int) -> [B, N] int64. Siblings share a position: they are alternatives for the same
    slot in the sequence."""
    if isinstance(start, torch.Tensor) and start.dim() == 1 and depth.dim() == 2:
        start = start.unsqueeze(1)
    return depth + start


def _walk_setup(tree: DraftTree, probs: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    if probs.shape[:2] != tree.tokens.shape:
        raise ValueError(f"per-node target must be [B, N, V] = "
                         f"[{tree.batch_size}, {tree.num_nodes}, V], got {tuple(probs.shape)}")
    path = torch.full((tree.batch_size, tree.max_depth() + 1), -1, dtype=torch.long,
                      device=probs.device)
    path[:, 0] = 0
    return tree_children(tree.parents, tree.valid), path.shape[1] - 1, path


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow the target's argmax down the tree.

    tree [B, N], target_logits [B, N, V] (row i: the target's prediction after node i's path)
    -> (accepted_path [B, D+1] int64 node indices, root first, -1 padded; accepted_len [B]
    int64 draft nodes accepted, root excluded; bonus [B] int64 = argmax at the last accepted
    node). D = tree.max_depth(). At each node the accepted child is the first valid child (in
    node order) whose token is the argmax (ties to the lowest id); distinct tokens make it
    unique, and a duplicated token resolves to its first copy.
    """
    children, d_max, path = _walk_setup(tree, target_logits)
    best = target_logits.argmax(dim=-1)  # [B, N]
    rows = torch.arange(tree.batch_size, device=best.device)
    cur = torch.zeros_like(rows)
    accepted_len = torch.zeros_like(rows)
    for d in range(d_max):
        kids = children[rows, cur]  # [B, C]
        kid_tok = tree.tokens.gather(1, kids.clamp(min=0))
        hit = (kids >= 0) & (kid_tok == best[rows, cur].unsqueeze(1))
        moved = hit.any(dim=1) & (accepted_len == d)  # rows that already stopped stay stopped
        nxt = kids.gather(1, hit.long().argmax(dim=1, keepdim=True)).squeeze(1)  # first hit
        cur = torch.where(moved, nxt, cur)
        path[:, d + 1] = torch.where(moved, nxt, -1)
        accepted_len += moved.long()
    return path, accepted_len, best[rows, cur]


def verify_tree_sampled(tree: DraftTree, draft_probs: torch.Tensor | None,
                        target_probs: torch.Tensor, generator: torch.Generator | None = None,
                        children: str = "topk") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless recursive rejection sampling over a draft tree.

    tree [B, N]; draft_probs [B, N, V] fp32: q at node i, the draft distribution node i's
    children came from (unused, may be None, for children="topk"); target_probs [B, N, V] fp32:
    p at node i. Both processed by `sampling.processed_probs` with the same settings.
    Returns (accepted_path [B, D+1], accepted_len [B], bonus [B]) as `verify_tree_greedy`;
    the bonus is the target-drawn token emitted after the accepted path.

    Rule. At the current node with target p and children x_1..x_m (node order), for j = 1..m:
    let r_j be the distribution x_j was actually drawn from given x_1..x_{j-1}; accept x_j with
    probability min(1, p(x_j) / r_j(x_j)) and move to it (fresh p, q of that node); otherwise
    set p <- norm(max(0, p - r_j)) and try the next child. If none is accepted, the bonus is
    drawn from the final p (at a leaf, p untouched). `children` says what r_j is:
      "topk"                deterministic children (EAGLE-2 top-k, reranking, pruning: any
                            deterministic function of the draft's outputs): r_j = one-hot(x_j),
                            so x_j is accepted with probability p(x_j) and a rejection removes
                            x_j from p. This is the rule of EAGLE's evaluate_posterior and
                            SGLang's tree_speculative_sampling_target_only.
      "iid"                 children drawn from q with replacement: r_j = q (SpecInfer's
                            multi-step speculative sampling).
      "without_replacement" children drawn from q without replacement in node order: r_j = q
                            with x_1..x_{j-1} removed, renormalized (Jeon et al. 2024, RSD).
    Why the emitted token is distributed as p: if x ~ r and a rejection leads to any procedure
    emitting norm(max(0, p - r)) whatever x was, then P(emit y) = r(y) min(1, p(y)/r(y)) +
    sum_v max(0, p_v - r_v) * norm(max(0, p - r))(y) = min(p(y), r(y)) + max(0, p(y) - r(y))
    = p(y). Induction over the remaining siblings (base case: sample the residual) makes each
    level lossless, and induction over depth (each accepted child restarts with fresh
    uniforms and its own p) makes every emitted token follow the target given its prefix.
    The premise "x_j ~ r_j" is essential: the q-ratio rules on top-k children (not drawn from
    q) are biased, and the sampled rules need the children to be exactly the draws, in draw
    order, with none dropped by value. "topk" conditions on the children, so it is lossless
    for ANY children chosen independently of the verifier's uniforms (deterministic, sampled,
    pruned), at a lower acceptance than the q-rules on trees really sampled from q. For
    "topk", P(accept a child) = sum_j p(x_j) (distinct x_j), the most any lossless rule can
    reach with those children. Duplicate tokens are safe: after a rejection the residual has
    no mass on the rejected token, so a later copy is never accepted.

    Randomness, in this order: torch.rand(B, D, C) acceptance uniforms (D = tree.max_depth(),
    C = most children of a node), then one `sample_from_probs` call on [B, V].
    """
    if children not in CHILD_MODES:
        raise ValueError(f"children must be one of {CHILD_MODES}, got {children!r}")
    if children != "topk" and draft_probs is None:
        raise ValueError(f"children={children!r} needs draft_probs")
    kids_table, d_max, path = _walk_setup(tree, target_probs)
    b, c = tree.batch_size, kids_table.shape[-1]
    rows = torch.arange(b, device=target_probs.device)
    u = torch.rand(b, d_max, c, generator=generator, device=target_probs.device)
    cur = torch.zeros_like(rows)
    accepted_len = torch.zeros_like(rows)
    p = target_probs[:, 0].float()
    q = None if children == "topk" else draft_probs[:, 0].float()
    for d in range(d_max):
        kids = kids_table[rows, cur]  # [B, C]
        walking = accepted_len == d
        nxt = torch.full_like(cur, -1)
        for j in range(c):
            kid = kids[:, j]
            trying = walking & (nxt < 0) & (kid >= 0)
            x = tree.tokens.gather(1, kid.clamp(min=0).unsqueeze(1))  # [B, 1]
            r = torch.zeros_like(p).scatter_(1, x, 1.0) if q is None else q
            p_x, r_x = p.gather(1, x).squeeze(1), r.gather(1, x).squeeze(1)
            ok = trying & accept_mask(u[:, d, j], p_x, r_x)
            rejected = (trying & ~ok).unsqueeze(1)
            p = torch.where(rejected, residual_probs(p, r), p)
            if children == "without_replacement":
                # Zeroing x_j and renormalizing gives the law of the next draw; an all-zero q
                # (siblings exhausted q's support) only arises for draws that cannot happen.
                q_next = q.scatter(1, x, 0.0)
                mass = q_next.sum(dim=1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
                q_next = q_next / mass
                q = torch.where(rejected, q_next, q)
            nxt = torch.where(ok, kid, nxt)
        moved = nxt >= 0
        cur = torch.where(moved, nxt, cur)
        path[:, d + 1] = nxt
        accepted_len += moved.long()
        p = torch.where(moved.unsqueeze(1), target_probs[rows, cur].float(), p)
        if q is not None:
            q = torch.where(moved.unsqueeze(1), draft_probs[rows, cur].float(), q)
    return path, accepted_len, sample_from_probs(p, generator)


def tree_emitted_tokens(tree: DraftTree, path: torch.Tensor, accepted_len: torch.Tensor,
                        bonus: torch.Tensor) -> torch.Tensor:
    """The tokens a verification emits: path [B, D+1], accepted_len [B], bonus [B] ->
    [B, D+1] int64 = tokens of path[1 : accepted_len+1], then bonus, then -1 (the chain
    verifiers' out_tokens layout)."""
    toks = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), -1)
    out = torch.cat([toks[:, 1:], toks.new_full((toks.shape[0], 1), -1)], dim=1)
    return out.scatter(1, accepted_len.unsqueeze(1), bonus.unsqueeze(1))


def tree_path_proposed(tree: DraftTree, path: torch.Tensor, accepted_len: torch.Tensor) -> torch.Tensor:
    """The depths a verification judged along its path: tree [B, N], path [B, D+1],
    accepted_len [B] -> [B] int64 = accepted_len, plus 1 when the last accepted node (the
    root when nothing was accepted) has a valid child. A depth the pruned tree never reached
    on that path was never proposed there, so α_k must not count it as a rejection."""
    last = path.gather(1, accepted_len.unsqueeze(1))  # [B, 1] node index, never -1
    has_child = ((tree.parents == last) & tree.valid).any(dim=1)
    return accepted_len + has_child.long()
