"""EAGLE-2 tree speculation in the engine: a head grows a dynamic draft tree, the target
verifies every node in one pass under a tree mask, the accepted path's KV is compacted.

One decode round for requests with x_n the last token (target cache holds 0..n-1):

  build    depth 1: the top-k children of the root x_n come from the head's carried logits.
           depth d = 1..D-1: the `frontier` best nodes of depth d run through the head in
           one batched `drafter.run` (position n+d-1, the head's shifted alignment); each node's
           hidden input is its parent's head output; its K/V go to scratch slot
           n + (d-1)*F + f of the head cache and it attends to the prefix plus its ancestors'
           scratch slots only (a [F, d*F] mask over the last d*F keys). Then prune to the
           `total_tokens` best nodes (cumulative draft log-prob), root kept.
  verify   root + nodes at target cache n..n+N-1, rotary position n + depth, tree mask;
           verify_tree_greedy / verify_tree_sampled (children = deterministic top-k, so the
           "topk" rule is the lossless one).
  compact  the accepted path's target K/V move from n + node to n + i; `drafter.accept`
           refills the head at n..n+a from the target's hidden states at the path's rows, as
           in the chain.

proposed[s] of a round is the depths its verification judged on the accepted path (the
accepted nodes, plus one when the last accepted node has a child; `tree_path_proposed`), so
α_k never counts a depth the pruned tree did not reach there.

Ties: tree children by (draft log-prob desc, token id asc), verification by the target's
argmax (lowest id on ties), the same rule greedy autoregressive decoding uses.
"""
from __future__ import annotations

import time

import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.layout import page_slots
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.request import Request
from inference_eval.engine.sampling import SamplingTensors
from inference_eval.engine.speculative.spec_engine import SpecEngine
from inference_eval.engine.speculative.tree import (TREE_FIELDS, DraftTree, tree_attention_mask,
                                                    tree_emitted_tokens, tree_expand, tree_init,
                                                    tree_limit, tree_path_proposed, tree_prune,
                                                    verify_tree_greedy, verify_tree_sampled)


class TreeSpecEngine(SpecEngine):
    k_key = "draft.depth"

    def __init__(self, model, tokenizer, cfg: EngineConfig | None, make_drafter, depth: int,
                 topk: int, total_tokens: int, frontier: int | None = None,
                 lookahead: int | None = None) -> None:
        """depth D: tree levels (the most tokens a round accepts, bonus excluded); topk:
        children per expanded node; total_tokens: draft nodes kept (root excluded);
        frontier F: nodes expanded per level (EAGLE-2 expands the top-k, so default topk);
        lookahead: cache slots the drafter writes past the last token (a DFlash block)."""
        self.topk, self.frontier, self.total = topk, frontier or topk, total_tokens
        scratch = (depth - 1) * self.frontier
        super().__init__(model, tokenizer, cfg, make_drafter, depth,
                         lookahead=max(total_tokens + 1, scratch + 1, lookahead or 0))
        if not self.drafter.drafts_trees:
            raise ValueError("draft.scheme=tree needs draft=head with an MTP/EAGLE head; use "
                             "scheme=chain for draft=llm or a Medusa head")

    def warm(self, batch_size: int = 1) -> None:
        """Besides the verify pass, the head's tree sizes: `frontier` nodes per request and
        level, and refills of up to depth + 1 accepted rows (at batch 1)."""
        super().warm(batch_size)
        if self.cfg.compile:
            self.drafter.warm(sorted({*range(1, self.max_accepted + 2), batch_size * self.frontier}))

    def _slots(self, reqs: list[Request], index: torch.Tensor) -> torch.Tensor:
        """Cache indices index [B, M] (-1 = none) -> flat slots [B, M] of each request's pages."""
        out = torch.full_like(index, -1)
        for b, r in enumerate(reqs):
            ok = index[b] >= 0
            out[b, ok] = page_slots(r.pages, index[b][ok].cpu(), self.cfg.page_size).to(out.device)
        return out

    # ---- build ----------------------------------------------------------------------------
    def _build(self, reqs: list[Request], ks: list[int], n: list[int]) -> DraftTree:
        """A pruned tree [B, total+1] per request, limited to depth ks[b] (0: root only)."""
        dev, b_all, size = self.device, len(reqs), self.total + 1
        roots = torch.tensor([r.token_ids[-1] for r in reqs], device=dev)
        root_only = torch.full((b_all, size), -1, dtype=torch.long, device=dev)
        root_only[:, 0] = 0
        full = tree_init(roots)[0].gather(root_only)  # root-only trees, padded to `size`
        live = [i for i in range(b_all) if ks[i] > 0]
        if not live:
            return full
        depth, f, lb = max(ks[i] for i in live), self.frontier, len(live)
        hid0, logits0 = self.drafter.begin_round([reqs[i] for i in live], [n[i] for i in live])
        lp0 = logits0.log_softmax(-1)  # hid0 [L, H]: the roots' head output
        tree, frontier = tree_init(roots[live])
        tree, frontier = tree_expand(tree, frontier, lp0.unsqueeze(1), self.topk, f)
        n_max = 1 + self.topk + (depth - 1) * f * self.topk  # nodes after the last expansion
        out_h = hid0.new_zeros(lb, n_max, hid0.shape[-1])  # each node's head output hidden
        out_h[:, 0] = hid0
        slot = torch.full((lb, n_max), -1, dtype=torch.long, device=dev)  # scratch index
        rows = torch.arange(lb, device=dev).unsqueeze(1)
        for d in range(1, depth):
            nodes = frontier.clamp(min=0)  # [L, F]; an empty slot stands in for the root
            slot[rows, nodes] = torch.where(frontier >= 0,
                                            (d - 1) * f + torch.arange(f, device=dev), -1)
            parents = tree.parents.gather(1, nodes).clamp(min=0)
            nxt, logits = self.drafter.grow(
                tree.tokens.gather(1, nodes).view(-1), out_h[rows, parents].view(lb * f, -1),
                lambda: self._level_plan([reqs[i] for i in live], [n[i] for i in live], tree,
                                         frontier, slot, d), d + 1)
            out_h[rows, nodes] = torch.where((frontier >= 0).unsqueeze(-1), nxt.view(lb, f, -1),
                                            out_h[rows, nodes])
            tree, frontier = tree_expand(tree, frontier, logits.view(lb, f, -1).log_softmax(-1),
                                         self.topk, f)
        tree = tree_limit(tree_prune(tree, size), torch.tensor([ks[i] for i in live], device=dev))
        idx = torch.tensor(live, device=dev)
        for name in TREE_FIELDS:
            getattr(full, name)[idx] = getattr(tree, name)
        return full

    def _level_plan(self, reqs: list[Request], n: list[int], tree: DraftTree,
                    frontier: torch.Tensor, slot: torch.Tensor, d: int):
        """The plan of depth d's frontier [L, F]: each node at scratch slot n + (d-1)*F + f of
        the head cache, attending to the prefix and its ancestors' scratch slots."""
        f = self.frontier
        mask = self._scratch_mask(tree.parents, frontier, slot, d * f)  # [L, F, d*F]
        # A request whose tree is cut shallower still runs; clamp keeps rope in range.
        pos = torch.tensor([min(m + d - 1, self.max_context - 1) for m in n], device=self.device)
        layout = BatchLayout([f] * len(reqs), [m + d * f for m in n], [r.pages for r in reqs],
                             self.cfg.page_size, positions=pos.repeat_interleave(f),
                             tree_masks=list(mask))
        return self.backend.plan(layout)

    @staticmethod
    def _scratch_mask(parents: torch.Tensor, frontier: torch.Tensor, slot: torch.Tensor,
                      m: int) -> torch.Tensor:
        """parents [L, N], frontier [L, F], slot [L, N] (-1: none) -> bool [L, F, m]: frontier
        node f sees the scratch entries of itself and its ancestors; an empty slot sees only
        its own entry m - F + f, so no attention row is empty."""
        lb, f = frontier.shape
        rows = torch.arange(lb, device=frontier.device).unsqueeze(1)
        mask = torch.zeros(lb, f, m + 1, dtype=torch.bool, device=frontier.device)
        cur, alive = frontier.clamp(min=0), frontier >= 0
        while bool(alive.any()):
            s = slot[rows, cur]
            mask.scatter_(2, torch.where(alive & (s >= 0), s, m).unsqueeze(-1), True)
            up = parents.gather(1, cur)
            alive, cur = alive & (up >= 0), up.clamp(min=0)
        own = torch.nn.functional.one_hot(m - f + torch.arange(f, device=frontier.device), m).bool()
        return torch.where((frontier < 0).unsqueeze(-1), own, mask[..., :m])

    # ---- one round ------------------------------------------------------------------------
    def _decode(self, reqs: list[Request], done: list[Request]) -> None:
        t0 = time.perf_counter()
        dev = self.device
        st = SamplingTensors.from_params([r.params for r in reqs], dev)
        n = [r.num_cached for r in reqs]
        ks = self.drafter.draft_lengths(reqs, n, [self._draft_len(r) for r in reqs])
        tree = self._build(reqs, ks, n)
        t0 = self._tick("draft", t0)
        m = tree.valid.sum(1).tolist()  # valid nodes are a prefix of each row
        masks = tree_attention_mask(tree.parents, tree.valid)
        nt = torch.tensor(n, device=dev)
        pos = torch.cat([nt[b] + tree.depth[b, :m[b]] for b in range(len(reqs))])
        layout = BatchLayout(m, [a + c for a, c in zip(n, m)], [r.pages for r in reqs],
                             self.cfg.page_size, positions=pos,
                             tree_masks=[masks[b, :m[b], :m[b]] for b in range(len(reqs))])
        ids = torch.cat([tree.tokens[b, :m[b]] for b in range(len(reqs))])
        out = self.model(ids, self.backend.plan(layout), self.cache, aux_layers=self.drafter.aux_layers)
        cu = layout.cu_q()
        tgt = self._per_request(out.logits, cu, tree.num_nodes)
        if st.all_greedy:
            path, acc, bonus = verify_tree_greedy(tree, tgt)
        else:
            path, acc, bonus = verify_tree_sampled(tree, None, self._target_probs(tgt, st),
                                                   self.generator, children="topk")
        emit = tree_emitted_tokens(tree, path, acc, bonus).tolist()
        # Compact: the accepted path's K/V from cache index n + node to n + i.
        depth_idx = torch.arange(path.shape[1], device=dev)
        on_path = (path >= 0) & (depth_idx <= acc.unsqueeze(1))
        src = self._slots(reqs, torch.where(on_path, nt.unsqueeze(1) + path, -1))
        dst = self._slots(reqs, torch.where(on_path, nt.unsqueeze(1) + depth_idx, -1))
        moved = on_path & (src != dst)
        self.cache.copy_slots(src[moved], dst[moved])
        t0 = self._tick("verify", t0)
        proposed = tree_path_proposed(tree, path, acc).tolist()
        acc, path = acc.tolist(), path.tolist()
        keep = self._record_round(reqs, proposed, acc, emit, n, done)
        self.drafter.accept([reqs[i] for i in keep], [n[i] for i in keep], [acc[i] for i in keep],
                            [emit[i] for i in keep], out,
                            [[cu[i] + node for node in path[i][:acc[i] + 1]] for i in keep])
        self._tick("catch_up", t0)
