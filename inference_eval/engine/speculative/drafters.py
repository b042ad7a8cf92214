"""Drafters: what proposes tokens in the speculative engine, behind one small interface.

Both share the target's page tables (one allocator, one block table per request); each owns
its KV cache. Alignment (ARCHITECTURE): the head's cache entry at position j is computed from
(h_j of the target, x_{j+1}), so its token buffer is the target's shifted left by one.
"""
from __future__ import annotations

import torch
from torch import nn

from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.linear import set_cpu_blas
from inference_eval.engine.model.transformer import StepContext, TransformerLM


class HeadDrafter:
    """An MTP/EAGLE head drafting in the engine. Carries, per request, the head's output at
    the last refilled position (hidden [H] and logits [V]) into the next round's first draft.
    `head` is a `heads.DraftHead` (its step, logits, first_hidden, embed and cfg are used); the
    engine takes it as given and never imports heads."""

    def __init__(self, head: nn.Module, num_pages: int, page_size: int, device, dtype) -> None:
        self.head = head.to(device=device, dtype=dtype).eval()
        self.cpu_blas = False  # the engine turns it on with its own setting (use_cpu_blas)
        a = head.arch
        self.cache = KVCache(1, num_pages, page_size, a.num_kv_heads, a.head_dim, dtype, device)
        self.aux_layers = list(head.cfg.aux_layers) if head.cfg.type == "eagle3" else []
        self.carry: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        d2t = head.draft_to_target()
        self.d2t = None if d2t is None else d2t.to(device)

    def run(self, tokens: torch.Tensor, hidden_in: torch.Tensor, plan,
            logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T], hidden_in [T, H] -> (next hidden [T, H], logits [T or R, V] in the
        target vocab); logit_rows [R] limits the lm_head to those rows (on a small target the
        draft's lm_head is a fifth of a target step: a refill only needs its last rows)."""
        ctx = StepContext(self.head.rope_cos[plan.positions], self.head.rope_sin[plan.positions],
                          plan, self.cache)
        nxt, feats = self.head.step(tokens, hidden_in, ctx)
        if logit_rows is not None:
            feats = feats.index_select(0, logit_rows)
        logits = self.head.logits(feats, self.cpu_blas).float()
        if self.d2t is not None:  # reduced vocabulary: tokens outside it get -inf
            full = logits.new_full((logits.shape[0], self.head.arch.vocab_size), float("-inf"))
            logits = full.index_copy(1, self.d2t, logits)
        return nxt, logits

    def refill(self, rids: list[int], tokens: torch.Tensor, target_hidden: torch.Tensor,
               target_aux: torch.Tensor | None, plan, last_rows: list[int]) -> None:
        """Write the head's cache from the target's states (more accurate than its own) and
        carry each request's last row into its next round."""
        hidden_in = self.head.first_hidden(target_hidden, target_aux)
        nxt, logits = self.run(tokens, hidden_in, plan,
                               torch.tensor(last_rows, dtype=torch.long, device=tokens.device))
        for j, (rid, row) in enumerate(zip(rids, last_rows)):
            self.carry[rid] = (nxt[row], logits[j])

    def use_cpu_blas(self, enabled: bool) -> None:
        set_cpu_blas(self.head, enabled)
        self.cpu_blas = enabled

    def drop(self, rid: int) -> None:
        self.carry.pop(rid, None)


class LLMDrafter:
    """A separate small LLM (same tokenizer) as draft. `cached[rid]` counts the positions
    whose draft KV is valid; each round first runs the tokens it has not seen (the bonus
    token, plus the last draft when all were accepted)."""

    def __init__(self, model: TransformerLM, num_pages: int, page_size: int, device, dtype) -> None:
        self.model = model.to(device=device, dtype=dtype).eval()
        a = model.arch
        self.cache = KVCache(a.num_layers, num_pages, page_size, a.num_kv_heads, a.head_dim,
                             dtype, device)
        self.cached: dict[int, int] = {}
        self.aux_layers: list[int] = []

    def use_cpu_blas(self, enabled: bool) -> None:
        set_cpu_blas(self.model, enabled)

    def forward(self, tokens: torch.Tensor, plan, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, plan, self.cache, logits_indices=logits_indices).logits

    def drop(self, rid: int) -> None:
        self.cached.pop(rid, None)

