"""`LookupDrafter`: n-gram lookup drafts (engine/speculative/lookup.py), alone or in front of a
model drafter.

Each round `draft_lengths` looks up a chain for every request. A request with one drafts it
(up to the round's K: the lookup costs no forward pass, and it is right more often than a
small head where it applies); a request without one drafts `model_draft` tokens from `inner`
(a head, an LLM, Medusa heads), or nothing when there is no inner drafter (the round is then a
plain decode step). Lookup drafts are handed to the engine as one-hot logits (0 at the token,
-inf elsewhere): greedy picks the token, sampling draws it with q = one-hot, so both
verifiers stay lossless unchanged.

The inner drafter still sees every prefill and every verified round (`accept` / `verified`)
so its cache and carry stay those of the target's tokens; only its `step`s are skipped for
requests that draft from lookup (a head refills its cache at the accepted positions anyway).
The engine counts `lookup_rounds`: rounds whose drafts came from lookup, per request.
"""
from __future__ import annotations

import torch

from inference_eval.engine.speculative.drafters import Drafter
from inference_eval.engine.speculative.lookup import ContextIndex, NgramTable, lookup_chain


class LookupDrafter(Drafter):
    def __init__(self, inner: Drafter | None, table: NgramTable | None, vocab_size: int, device,
                 model_draft: int | None = None, min_match: int = 2, max_match: int = 8) -> None:
        """inner: the model drafter of rounds lookup finds nothing for (None: lookup only);
        table: the corpus n-grams (None: the request's own context only); model_draft: the
        inner drafter's draft length (None: the round's K); min_match / max_match: the
        context n-gram lengths tried (longest first)."""
        if model_draft is not None and model_draft < 1:
            raise ValueError(f"draft.model_draft must be >= 1, got {model_draft}")
        if inner is not None and inner.max_steps is not None and model_draft is not None \
                and model_draft > inner.max_steps:
            raise ValueError(f"draft.model_draft={model_draft} is more than the {inner.max_steps} "
                             "draft steps the model drafter has")
        self.inner, self.table, self.vocab_size = inner, table, vocab_size
        self.device = torch.device(device)
        self.model_draft = model_draft
        if inner is not None and model_draft is None:
            self.model_draft = inner.max_steps  # None (the round's K) unless Medusa's heads cap it
        self.min_match, self.max_match = min_match, max_match
        self.aux_layers = list(inner.aux_layers) if inner is not None else []
        self.sync_free = inner is not None and inner.sync_free
        self.contexts: dict[int, ContextIndex] = {}
        self.chains: dict[int, list[int]] = {}

    # ---- the inner drafter's life cycle ---------------------------------------------------
    def bind(self, backend, cpu_blas, weight_codes=True, head_code="none", counters=None):
        # The inner drafter first: our bind forwards use_cpu_blas, which packs its weights
        # by the codes its own bind records.
        if self.inner is not None:
            self.inner.bind(backend, cpu_blas, weight_codes, head_code, counters)
        super().bind(backend, cpu_blas, weight_codes, head_code, counters)
        self.counters.setdefault("lookup_rounds", 0)  # a run that never matched reports 0

    def use_cpu_blas(self, enabled):
        if self.inner is not None:
            self.inner.use_cpu_blas(enabled)

    def warm(self, rows):
        if self.inner is not None:
            self.inner.warm(rows)

    def prefill(self, reqs, layout, plan, pending, sampled, out):
        if self.inner is not None:
            self.inner.prefill(reqs, layout, plan, pending, sampled, out)

    def accept(self, reqs, n, accepted, emitted, out, rows):
        if self.inner is not None:
            self.inner.accept(reqs, n, accepted, emitted, out, rows)

    def verified(self, reqs, plan, row_tokens, out, last_rows):
        if self.inner is not None:
            self.inner.verified(reqs, plan, row_tokens, out, last_rows)

    def drop(self, rid):
        self.contexts.pop(rid, None)
        self.chains.pop(rid, None)
        if self.inner is not None:
            self.inner.drop(rid)

    # ---- a round ----------------------------------------------------------------------------
    def draft_lengths(self, reqs, n, ks):
        out, model = [], []
        for r, k in zip(reqs, ks):
            ctx = self.contexts.get(r.id)
            if ctx is None:
                ctx = self.contexts[r.id] = ContextIndex(self.min_match, self.max_match)
            ctx.sync(r.token_ids)
            chain = lookup_chain(ctx, self.table, k) if k > 0 else []
            self.chains[r.id] = chain
            if chain:
                self.counters["lookup_rounds"] += 1
                out.append(len(chain))
            elif self.inner is None:
                out.append(0)
            else:
                model.append(len(out))
                out.append(k if self.model_draft is None else min(k, self.model_draft))
        if model:  # the model's rows: its own say too (a block drafter needs room for a block)
            got = self.inner.draft_lengths([reqs[i] for i in model], [n[i] for i in model],
                                           [out[i] for i in model])
            for i, k in zip(model, got):
                out[i] = k
        return out

    def _one_hot(self, tokens: list[int]) -> torch.Tensor:
        """[L] token ids -> [L, V] logits that put all mass on them."""
        logits = torch.full((len(tokens), self.vocab_size), float("-inf"), device=self.device)
        logits[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 0.0
        return logits

    def _split(self, reqs) -> tuple[list[int], list[int]]:
        look, model = [], []
        for j, r in enumerate(reqs):
            (look if self.chains.get(r.id) else model).append(j)
        return look, model

    _conf: torch.Tensor | None = None

    def begin_round(self, reqs, n):
        """-> (state [L, ...] or None, logits [L, V]); lookup rows are one-hot."""
        look, model = self._split(reqs)
        self._conf = None
        if not look:
            got = self.inner.begin_round(reqs, n)
            self._conf = self.inner.confidence()
            return got
        drafts = self._one_hot([self.chains[reqs[j].id][0] for j in look])
        if not model:
            return None, drafts
        state, logits = self.inner.begin_round([reqs[j] for j in model], [n[j] for j in model])
        self._merge_confidence(len(reqs), model)
        return self._merge(len(reqs), look, drafts, model, state, logits)

    def step(self, reqs, n, s, tokens, state):
        """tokens [L] (d_s), state [L, ...] or None -> (state, logits [L, V])."""
        look, model = self._split(reqs)
        self._conf = None
        if not look:
            got = self.inner.step(reqs, n, s, tokens, state)
            self._conf = self.inner.confidence()
            return got
        drafts = self._one_hot([self.chains[reqs[j].id][s] for j in look])
        if not model:
            return state, drafts
        sub = None if state is None else state[torch.tensor(model, device=state.device)]
        nxt, logits = self.inner.step([reqs[j] for j in model], [n[j] for j in model], s,
                                      tokens[torch.tensor(model, device=tokens.device)], sub)
        self._merge_confidence(len(reqs), model)
        return self._merge(len(reqs), look, drafts, model, nxt, logits)

    def confidence(self):
        return self._conf

    def _merge_confidence(self, size: int, model: list[int]) -> None:
        """The inner drafter's confidences at its rows and 1 at the lookup rows (a one-hot law's
        top probability), or None when the inner drafter has no confidence head."""
        conf = self.inner.confidence()
        if conf is not None:
            self._conf = conf.new_ones(size)
            self._conf[torch.tensor(model, device=conf.device)] = conf

    def _merge(self, size, look, drafts, model, state, logits):
        """drafts [len(look), V], logits [len(model), V], state [len(model), ...] or None ->
        (state [size, ...] or None, logits [size, V]) in the batch's order; a lookup row's
        state is zeros (never read: its request takes no model step this round)."""
        out = drafts.new_empty(size, drafts.shape[1])
        out[torch.tensor(look, device=out.device)] = drafts
        out[torch.tensor(model, device=out.device)] = logits.to(out.dtype)
        if state is None:
            return None, out
        full = state.new_zeros(size, *state.shape[1:])
        full[torch.tensor(model, device=state.device)] = state
        return full, out
