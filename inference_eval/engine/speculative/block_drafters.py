"""Block drafters: one draft pass per round proposes all of its drafts, behind the same
`Drafter` verbs the chain engine calls (drafters.py).

`begin_round` runs the pass and returns d_1's law; the laws of d_2..d_K [L, K-1, V] stay in
the drafter, and the round's `state` is each request's row of them [L, 1]; `step` s only hands
out law s + 1 (the engine selects the state's rows of the requests still drafting, as for any
drafter). The pass's laws do not depend on the tokens drawn before them (the transition bias
below is added once its token is drawn), so the engine still draws d_k from exactly the law
q_k it passes to verification, and greedy and sampled verification stay lossless; the
confidence cut (draft.min_confidence) reads the same laws. The tree engine grows a tree over
them with `grow`: every node of depth d gets the law of d_{d+1}, so the tree is the block's
per-position top-k (draft.scheme=tree, its depth <= the block's drafts). A head with the
transition bias (head.markov_rank) adds, to the law of d_{k}, its bias read from the token
drawn before it (`step`, `grow`): each law is still the one its draft is drawn from and
verified against, and a tree node's children then depend on the node's own token. With
head.markov_first a DFlash head's d_1 is biased too, from the block's anchor (the last
verified token, known before the pass).

- `ParallelHeadDrafter`: a P-EAGLE head (heads/eagle3.py, parallel_drafting). Its cache and
  refills are `HeadDrafter`'s (the head's index j holds (h_j, x_{j+1})); a round's steps
  2..K are mask rows at head indices n..n+K-2, run as one causal pass of K-1 rows, which is
  the chain of step calls they would be (no row reads a draft token). d_1 comes from the
  refill, so the pass waits for d_1's cut (it runs at the round's first `step`).
- `BlockContextDrafter`: a DFlash head (heads/dflash.py). Its own paged cache (one entry per
  draft layer and verified position, on the target's page tables) holds the keys and values
  of the injected context c_j, written at prefill and after each verification from the
  target's aux states; a round writes its block [x_n, m, ..., m] at indices n..n+B-1 and
  attends over [context ; block] with a tree mask of ones over the block (bidirectional
  inside, causal to the context). Those block entries are scratch: verification's refill
  overwrites the verified ones, the rest are never read before being rewritten.
"""
from __future__ import annotations

import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.transformer import StepContext
from inference_eval.engine.speculative.drafters import Drafter, HeadDrafter, _HeadLogits


class _PrecomputedLaws:
    """The verbs of a drafter whose round is one pass: `_round_laws` computes every law of the
    round; the round's state is each request's row [L, 1] of them (the engine selects state
    rows, and a tree's nodes carry their request's row), and a law depends on the tokens
    drawn before it only through the transition bias, if the head has one: without it a tree
    node of depth d gets law d + 1 whatever its parent, so a tree over a block is the
    per-position top-k (children of every node at depth d: the top-k of q_{d+1}); with it, the
    top-k of q_{d+1} after the node's own token. Either way `topk` tree verification stays
    lossless (its children are deterministic)."""

    drafts_trees = True
    _laws: torch.Tensor | None = None  # [L, K-1, V]: d_2..d_K of the round's requests

    def _round_laws(self, reqs, n) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (laws of d_2..d_K [L, K-1, V], law of d_1 [L, V]) of the round's one pass."""
        raise NotImplementedError

    def begin_round(self, reqs, n):
        self._laws, first = self._round_laws(reqs, n)
        return torch.arange(len(reqs), device=first.device).unsqueeze(1), first

    def step(self, reqs, n, s, tokens, state):
        """state [L, 1]: the requests' rows of the round, tokens [L] = d_s -> (state, the law
        of d_{s+1} [L, V])."""
        return state, self._law(state[:, 0], s - 1, tokens)

    def grow(self, tokens, state, plan, k):
        """Tree nodes of depth k - 1 (tokens [M]), state [M, 1] their requests' rows ->
        (state, the law of their children [M, V]); only the transition bias, if any, runs, so
        the level's plan is never built."""
        return state, self._law(state[:, 0], k - 2, tokens)

    def _law(self, rows: torch.Tensor, j: int, prev: torch.Tensor) -> torch.Tensor:
        """The law of d_{j+2} for the round rows `rows` [M] after the tokens prev [M]: the
        pass's, plus the head's transition bias from prev when it has one (heads/transition:
        the only law of a round that depends on a drawn token, computed once it is drawn)."""
        return self._biased(self._laws[rows, j], prev)  # the rows' laws: a copy [M, V]

    def _biased(self, law: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """law [M, V] (changed in place) plus the transition bias read from prev [M], if the
        head has one."""
        bias = self.head.transition
        if bias is None:
            return law
        b = bias(prev)  # [M, V_draft]
        if self.d2t is None:
            return law.add_(b)
        # into the draft vocabulary's columns only, row by row (the scatter _to_target uses)
        return law.scatter_add_(1, self.d2t.expand(b.shape[0], -1), b)


class ParallelHeadDrafter(_PrecomputedLaws, HeadDrafter):
    """A P-EAGLE head: d_1 from the refill's carry, d_2..d_K from one pass of mask rows.

    d_1's law is known before the pass (the refill made it), and no mask row reads d_1, so
    the pass waits for d_1's cut: `begin_round` hands out the carry only, and the pass runs
    at the first `step` for the requests still drafting (a round whose d_1 the confidence
    cut refuses costs no pass), or at a tree's first `grow` for all of the round's."""

    _mask_in: tuple[torch.Tensor, torch.Tensor] | None = None  # head.mask_inputs(), once
    _round: tuple[list, list[int]] | None = None  # begin_round's (reqs, n) until the pass ran

    def draft_lengths(self, reqs, n, ks):
        self.round_ks = {r.id: k for r, k in zip(reqs, ks)}
        return list(ks)

    def begin_round(self, reqs, n):
        first = self._carried(reqs)[1]  # [L, V]
        self._laws, self._round = None, (list(reqs), list(n))
        return torch.arange(len(reqs), device=first.device).unsqueeze(1), first

    def step(self, reqs, n, s, tokens, state):
        if s == 1:  # d_1 kept: the pass for the requests drafting on, rows renumbered 0..L-1
            self._laws, self._round = self._mask_laws(reqs, n), None
            state = torch.arange(len(reqs), device=state.device).unsqueeze(1)
        return super().step(reqs, n, s, tokens, state)

    def grow(self, tokens, state, plan, k):
        if self._laws is None:  # a tree's first level: the pass for every request of the round
            self._laws, self._round = self._mask_laws(*self._round), None
        return super().grow(tokens, state, plan, k)

    def _mask_laws(self, reqs, n) -> torch.Tensor:
        """The laws of d_2..d_K [L, K-1, V] of `reqs`, from one pass of their mask rows."""
        like = self._refilled[2]  # the last refill's logits: the laws' dtype, device and V
        ks = [self.round_ks.get(r.id, 1) for r in reqs]
        deep = [i for i, k in enumerate(ks) if k > 1]
        laws = like.new_zeros(len(reqs), max(max(ks) - 1, 0), like.shape[-1])
        if not deep:
            return laws
        # Step k of request i sits at head index n_i + k - 2: rows n_i .. n_i + K_i - 2.
        q = [ks[i] - 1 for i in deep]
        layout = self._layout([reqs[i] for i in deep], q, [n[i] + j for i, j in zip(deep, q)])
        logits = self._mask_pass(sum(q), self.backend.plan(layout))
        start = 0
        for i, m in zip(deep, q):
            laws[i, :m] = logits[start:start + m]
            start += m
        return laws

    def _mask_pass(self, rows: int, plan) -> torch.Tensor:
        """Steps 2..K of `rows` rows -> logits [rows, V]. Not through run(): its compiled
        steps and CUDA graphs are step 1's (k is not an input). Every mask row reads the same
        input, a constant of the head: computed at the first pass (fc's A*H x H product)."""
        ctx = StepContext(self.head.rope_cos[plan.positions], self.head.rope_sin[plan.positions],
                          plan, self.cache)
        if self._mask_in is None:
            self._mask_in = tuple(t.to(self.cache.k.dtype) for t in self.head.mask_inputs())
        return self._logits(self.head.mask_step(rows, ctx, self._mask_in)[1])


class BlockContextDrafter(_PrecomputedLaws, _HeadLogits, Drafter):
    """A DFlash head: context keys/values in its own paged cache, one block pass per round."""

    # With a confidence head (head.confidence_head): the round's draft rows' features
    # [L, B-1, H], its anchors [L], and the predicted acceptance [L] of the drafts last handed out
    _feats: torch.Tensor | None = None
    _anchor: torch.Tensor | None = None
    _conf: torch.Tensor | None = None

    def __init__(self, head, num_pages: int, page_size: int, device, dtype,
                 cache_arch=None) -> None:
        """cache_arch: the arch of the context cache (default head.arch; under tensor
        parallelism the rank's local KV heads)."""
        self._setup(head, device, dtype)
        self.page_size = page_size
        a = head.arch if cache_arch is None else cache_arch
        self.cache = KVCache.for_arch(a, num_pages, page_size, dtype, device)
        self.aux_layers = list(head.cfg.aux_layers)
        self.block = head.block_size
        self.max_steps = self.block - 1
        self._consts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def draft_lengths(self, reqs, n, ks):
        """A block needs cache indices n..n+B-1 inside the request's pages and the rotary
        table; a request without that room drafts nothing this round (a plain decode step)."""
        rope = self.head.rope_cos.shape[0]
        return [min(k, self.block - 1) if len(r.pages) * self.page_size >= m + self.block
                and m + self.block <= rope else 0 for r, m, k in zip(reqs, n, ks)]

    def _write_context(self, aux: torch.Tensor, layout: BatchLayout) -> None:
        """aux [T, A, H] of the layout's new tokens -> every draft layer's context keys and
        values at their cache indices (the head's layer_context_kv)."""
        self._cache_context(self.head.context(aux.to(self.cache.k.dtype)), layout)

    def _cache_context(self, c: torch.Tensor, layout: BatchLayout) -> None:
        """Context states c [T, H] -> each layer's keys and values at the layout's slots."""
        head, dev = self.head, self.device
        pos, slots = layout.position_tensor(dev), layout.slot_mapping(dev)
        for i in range(self.cache.k.shape[0]):
            k, v = head.layer_context_kv(i, c, pos)
            kc, vc = self.cache.layer(i)
            kc.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(kc.dtype))
            vc.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(vc.dtype))

    def prefill(self, reqs, layout, plan, pending, sampled, out):
        self._write_context(out.aux, layout)

    def accept(self, reqs, n, accepted, emitted, out, rows):
        if not reqs:
            return
        flat = torch.tensor([j for r in rows for j in r], device=out.aux.device)
        layout = self._layout(reqs, [a + 1 for a in accepted],
                              [m + a + 1 for m, a in zip(n, accepted)])
        self._write_context(out.aux.index_select(0, flat), layout)

    def begin_round(self, reqs, n):
        state, first = super().begin_round(reqs, n)
        self._conf = self._confidence_at(state[:, 0], 0, self._anchor)
        return state, first

    def step(self, reqs, n, s, tokens, state):
        state, law = super().step(reqs, n, s, tokens, state)
        self._conf = self._confidence_at(state[:, 0], s, tokens)
        return state, law

    def confidence(self):
        return self._conf

    def _confidence_at(self, rows: torch.Tensor, j: int, prev: torch.Tensor) -> torch.Tensor | None:
        """The confidence head's predicted acceptance [M] of d_{j+1} for the round rows `rows`
        [M] after the tokens prev [M] (d_j, the anchor for j = 0); None without the head."""
        if self.head.confidence is None:
            return None
        return torch.sigmoid(self.head.confidence_logit(self._feats[rows, j], prev).float())

    def _round_laws(self, reqs, n):
        b, L = self.block, len(reqs)
        last = torch.tensor([r.token_ids[-1] for r in reqs], device=self.device)
        self._anchor = last
        ones, rows = self._block_consts(L)
        layout = BatchLayout([b] * L, [m + b for m in n], [r.pages for r in reqs], self.page_size,
                             tree_masks=[ones] * L)
        _, logits = self.run(self.head.block_tokens(last), None, self.backend.plan(layout), rows)
        laws = logits.view(L, b - 1, -1)
        if self._feats is not None:
            self._feats = self._feats.view(L, b - 1, -1)
        if self.head.cfg.markov_first:  # d_1 biased from the anchor (DSpark's convention)
            return laws[:, 1:], self._biased(laws[:, 0].clone(), last)
        return laws[:, 1:], laws[:, 0]

    def _block_consts(self, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's mask (ones [B, B]: bidirectional inside) and the mask rows [L * (B-1)]
        of L blocks, built once per batch size: a round's pass is a few hundred µs on a CPU."""
        got = self._consts.get(L)
        if got is None:
            b = self.block
            ones = torch.ones(b, b, dtype=torch.bool, device=self.device)
            rows = torch.arange(L * b, device=self.device).view(L, b)[:, 1:].reshape(-1)
            got = self._consts[L] = (ones, rows)
        return got

    def run(self, tokens, state, plan, rows=None, k=1):
        """One block pass: tokens [J * B] (block_tokens) over a plan with the blocks' masks,
        rows [R] the rows that get logits -> (None, logits [R, V] fp32). With a state
        instead (a call under tensor parallelism, parallel/spec.py): context states c [T, H]
        written at the plan's layout, tokens unused -> (None, None)."""
        if state is not None:
            self._cache_context(state, plan.layout)
            return None, None
        head = self.head
        ctx = StepContext(head.rope_cos[plan.positions], head.rope_sin[plan.positions], plan,
                          self.cache)
        feats = head.block_features(tokens, ctx, rows)
        if head.confidence is not None:  # the rows' features: what the confidence head reads
            self._feats = feats
        return None, self._logits(feats)

    def drop(self, rid):
        pass

