"""Drafters: what proposes tokens in the speculative engines, behind one interface.

The chain engine (`SpecEngine`) and the tree engine (`TreeSpecEngine`) call only the verbs of
`Drafter` and never look inside one. A round, for requests whose last token x_n sits at cache
index n (the target cache holds 0..n-1), runs

    prefill(reqs, layout, plan, pending, sampled, out)  once per (re)computed prompt
    ks = draft_lengths(reqs, n, ks)                     each request's drafts this round
    state, logits = begin_round(reqs, n)                logits [L, V]: the law of d_1
    state, logits = step(reqs, n, s, d_s, state)        s = 1..K-1: the law of d_{s+1}
    accept(reqs, n, accepted, emitted, out, rows)       after verification
    drop(rid)                                           when a request finishes

With engine.compile the engine first calls `warm(rows)` with the row counts its rounds
will use, so a drafter can compile its steps for them (before anything is timed).

A `sync_free` drafter instead catches up in `verified(reqs, plan, row_tokens, out,
last_rows)`, called right after the verify pass and before the host learns how much was
accepted, so no device-to-host read stands between verification and the next draft (the
target's hidden states go straight to the head while the sampler reads the logits): it re-runs
over every verified row with the target's layout and plan, and keeps the rows at the accepted
ends (device indices) as the next round's state; `accept` is then not called.

`state` is the drafter's own per-request carry (a [L, ...] tensor, or None): the engine only
selects its rows for the requests still drafting. A tree engine grows its nodes with
`grow(tokens, state, plan, k)` on layouts it plans itself (scratch slots and masks), which
only drafters with `drafts_trees` support (a head runs them; a block drafter hands out the
round's law of depth k, block_drafters.py).

Three drafters share the target's page tables (one allocator, one block table per request):
- `HeadDrafter`: an MTP/EAGLE head with its own KV cache (one layer, or an EAGLE-3 head's
  N). Alignment (the table in heads/rollout.py): the head's cache entry at index j is
  computed from (h_j of the target, x_{j+1}), so its token buffer is the target's shifted left by one; after each round
  it is refilled at the accepted positions from the target's hidden states (more accurate than
  its own).
- `LLMDrafter`: a separate small LLM (same tokenizer) with its own full KV cache, unshifted.
- `MedusaDrafter`: Medusa heads, no KV cache and no token input: head k maps the target's
  post-norm feature at the last accepted position to the token k+1 places after it.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.cpu_quant import code_weights
from inference_eval.engine.model.compiled import CompiledHeadSteps, CompiledSteps, compilable
from inference_eval.engine.model.linear import set_cpu_blas
from inference_eval.engine.model.transformer import ModelOutput, StepContext, TransformerLM
from inference_eval.engine.request import Request

Rows = Sequence[Sequence[int]]


class Drafter:
    """The interface both engines call (see the module docstring for one round).

    aux_layers: target layers whose outputs `prefill` / `accept` read in `out.aux` (EAGLE-3).
    drafts_trees: `grow` can draft the nodes of a tree (a head: in its shifted alignment).
    max_steps: the most draft tokens one round can have (None: unbounded; Medusa: its heads).
    """

    aux_layers: list[int] = []
    drafts_trees = False
    sync_free = False
    max_steps: int | None = None
    backend = None  # set by bind()

    def bind(self, backend, cpu_blas: bool, weight_codes: bool = True,
             head_code: str = "none", counters: dict[str, int] | None = None) -> None:
        """The engine's attention backend (a drafter plans its own layouts with it) and its
        CPU BLAS setting (the draft's GEMMs take the target's path; `weight_codes` and
        `head_code`, engine.weight_codes / engine.head_code, say how on that path);
        `counters`: the engine's per-run counts, where a drafter adds its own."""
        self.backend = backend
        self.weight_codes, self.head_code = weight_codes, head_code
        self.counters = {} if counters is None else counters
        self.use_cpu_blas(cpu_blas)

    weight_codes = True  # set by bind()
    head_code = "none"

    def use_cpu_blas(self, enabled: bool) -> None:
        pass

    def warm(self, rows: Sequence[int]) -> None:
        """engine.compile: compile the draft's steps of these row counts (no-op by default)."""

    def draft_lengths(self, reqs: list[Request], n: list[int], ks: list[int]) -> list[int]:
        """Before a round: ks[i] is the most drafts request i may have (the engine's K, cut
        near max_new_tokens and the context end) -> how many it will have (each <= ks[i]; 0:
        a plain decode step). By default all of them."""
        return list(ks)

    def prefill(self, reqs: list[Request], layout: BatchLayout, plan, pending: list[list[int]],
                sampled: list[int], out: ModelOutput) -> None:
        """After the target's prefill of `layout` (its `plan`): pending[i] are the tokens
        request i fed (its q_len), sampled[i] the token the target drew after them;
        out.hidden [T, H] (pre-norm), out.aux [T, A, H] or None."""
        raise NotImplementedError

    def begin_round(self, reqs: list[Request], n: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """-> (state [L, ...] or None, logits [L, V] fp32 in the target vocabulary): the
        distribution of each request's first draft d_1 (x_n at index n[i] is the last token)."""
        raise NotImplementedError

    def step(self, reqs: list[Request], n: list[int], s: int, tokens: torch.Tensor,
             state: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Draft step s + 1 (1-based): tokens [L] = d_s, state from the previous call ->
        (state, logits [L, V] fp32 of d_{s+1})."""
        raise NotImplementedError

    def confidence(self) -> torch.Tensor | None:
        """The predicted acceptance [L] of the drafts whose laws the last begin_round / step
        returned, from a learned confidence head (DSpark's); None: the engine's
        draft.min_confidence cut reads each law's top probability instead."""
        return None

    def accept(self, reqs: list[Request], n: list[int], accepted: list[int],
               emitted: list[list[int]], out: ModelOutput, rows: Rows) -> None:
        """After verification: request i emitted emitted[i][:accepted[i] + 1] (its drafts,
        then the target's token); rows[i] are the accepted[i] + 1 rows of the verify output
        `out` that held x_n and the accepted drafts (the target cache is valid to
        n[i] + accepted[i])."""
        raise NotImplementedError

    def verified(self, reqs: list[Request], plan, row_tokens: torch.Tensor, out: ModelOutput,
                 last_rows: torch.Tensor) -> None:
        """The sync-free catch-up (only when `sync_free`): `plan` is the verify pass's,
        row_tokens [T] the token that follows each verified row where it is kept, out the
        verify output (hidden [T, H]), last_rows [B] the row of each request's last
        emitted token (on the device: the accepted lengths are not on the host yet)."""
        raise NotImplementedError

    def run(self, tokens: torch.Tensor, state: torch.Tensor | None, plan,
            rows: torch.Tensor | None = None, k: int = 1) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One forward of the draft model over a planned layout: tokens [T], state [T, ...]
        -> (next state [T, ...] or None, logits [T or R, V] fp32); rows [R] limits the
        lm_head to those rows; k: the 1-based draft step the tokens are drafted for."""
        raise NotImplementedError

    def grow(self, tokens: torch.Tensor, state: torch.Tensor | None, plan: Callable,
             k: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A tree engine's nodes of depth k - 1: tokens [M], state [M, ...] their parents'
        states, plan() the plan of their layout (scratch slots and ancestor masks; built only
        when asked) -> (their states, logits [M, V] fp32 of their children, drafts of step k).
        A head runs them."""
        return self.run(tokens, state, plan(), k=k)

    def drop(self, rid: int) -> None:
        pass

    def _layout(self, reqs: list[Request], q_lens: list[int], kv_lens: list[int]) -> BatchLayout:
        return BatchLayout(q_lens, kv_lens, [r.pages for r in reqs], self.page_size)


def _last_rows(layout: BatchLayout) -> list[int]:
    return [c - 1 for c in layout.cu_q()[1:]]


class _HeadLogits:
    """The lm_head of a heads.DraftHead in the target vocabulary: a reduced vocabulary
    (EAGLE-3 d2t) is scattered back with -inf for the tokens outside it."""

    coded_as = "none"  # the block code the head's weights were rounded to (use_cpu_blas)

    def _setup(self, head: nn.Module, device, dtype) -> None:
        self.head = head.to(device=device, dtype=dtype).eval()
        self.device, self.cpu_blas = torch.device(device), False
        d2t = head.draft_to_target()
        self.d2t = None if d2t is None else d2t.to(device)

    def use_cpu_blas(self, enabled: bool) -> None:
        """On the fast path with a head_code (engine.head_code) the head's trained weights are
        rounded to that block code once, so its products read the code (cpu_quant.code_weights)."""
        if enabled and self.head_code not in ("none", self.coded_as):
            code_weights(self.head, self.head_code)
            self.coded_as = self.head_code
        set_cpu_blas(self.head, enabled, codes=self.weight_codes)
        self.cpu_blas = enabled

    def _logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self._to_target(self.head.logits(feats, self.cpu_blas).float())

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, V_draft] -> [T, V] (identity without a reduced vocabulary)."""
        if self.d2t is not None:
            # scatter_ along the rows: index_copy over dim 1 took twice as long (a draft
            # step's 8192 of 49152 columns: 23 vs 12 µs a row on the 2-core EPYC).
            full = logits.new_full((logits.shape[0], self.head.arch.vocab_size), float("-inf"))
            logits = full.scatter_(1, self.d2t.expand(logits.shape[0], -1), logits)
        return logits


class HeadDrafter(_HeadLogits, Drafter):
    """An MTP/EAGLE head drafting in the engine. `carry[rid]`: the head's output at the last
    refilled position (hidden [H], logits [V]), the state of the next round's first draft.
    `head` is a `heads.DraftHead` (its step, logits, first_hidden, draft_to_target, rope
    tables and cfg are used); the engine takes it as given and never imports heads."""

    drafts_trees = True
    # (request ids, states [L, H], logits [L, V]) of the last refill, replaced by each refill
    _refilled: tuple[list[int], torch.Tensor | None, torch.Tensor | None] = ([], None, None)

    def __init__(self, head: nn.Module, num_pages: int, page_size: int, device, dtype,
                 sync_free: bool = False, cache_arch=None) -> None:
        """cache_arch: the arch of the head's cache (default head.arch; under tensor
        parallelism the rank's local KV heads)."""
        self._setup(head, device, dtype)
        # The head's layer has the target's attention shape, so the verify plan serves it.
        self.sync_free = sync_free
        self.page_size = page_size
        a = head.arch if cache_arch is None else cache_arch
        self.cache = KVCache.for_arch(a, num_pages, page_size, dtype, device)  # a: the head's layers
        self.aux_layers = list(head.cfg.aux_layers) if head.cfg.type == "eagle3" else []
        self.carry: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.compiled = None

    def warm(self, rows):
        """Both state widths: the target's (refills: first_hidden) and the head's own."""
        if not compilable(self.head):
            return
        if self.compiled is None:
            self.compiled = CompiledHeadSteps(self.head)
        h = self.head.arch.hidden_size
        aux = torch.zeros(1, len(self.aux_layers), h) if self.aux_layers else None
        first = self.head.first_hidden(torch.zeros(1, h), aux).shape[-1]
        for width in sorted({h, first}):
            self.compiled.warm(rows, (width,))

    def run(self, tokens, state, plan, rows=None, k=1):
        """On a small target the draft's lm_head is a fifth of a target step: a refill only
        needs its last rows, hence `rows` (a compiled step computes them all: it is small)."""
        ctx = StepContext(self.head.rope_cos[plan.positions], self.head.rope_sin[plan.positions],
                          plan, self.cache)
        c, g = self.compiled, getattr(plan, "graphs", None)
        got = None
        if c is not None and c.applies(tokens.shape[0], state):
            got = c(tokens, state, ctx)
        elif g is not None:  # CUDA graphs (model/cuda_graphs.py)
            got = g.head_step(self.head, tokens, state, ctx, self.cache)
        if got is not None:
            nxt, logits = got
            return nxt, self._to_target(logits if rows is None else logits.index_select(0, rows))
        nxt, feats = self.head.step(tokens, state, ctx, k=k)
        return nxt, self._logits(feats if rows is None else feats.index_select(0, rows))

    def refill(self, rids: list[int], tokens: torch.Tensor, target_hidden: torch.Tensor,
               target_aux: torch.Tensor | None, plan, last_rows: list[int] | torch.Tensor) -> None:
        """Write the head's cache from the target's states (step 1 of the rollout) and carry
        each request's last row (host list or device tensor) into its next round."""
        hidden_in = self.head.first_hidden(target_hidden, target_aux)
        rows = torch.as_tensor(last_rows, dtype=torch.long, device=tokens.device)
        nxt, logits = self.run(tokens, hidden_in, plan, rows)
        last = nxt.index_select(0, rows)
        for j, rid in enumerate(rids):
            self.carry[rid] = (last[j], logits[j])
        self._refilled = (list(rids), last, logits)

    def verified(self, reqs, plan, row_tokens, out, last_rows):
        self.refill([r.id for r in reqs], row_tokens, out.hidden, out.aux, plan, last_rows)

    def prefill(self, reqs, layout, plan, pending, sampled, out):
        # Shifted alignment: the entry at index j reads x_{j+1}, so the sampled token closes it.
        shifted = [t for p, s in zip(pending, sampled) for t in p[1:] + [s]]
        self.refill([r.id for r in reqs], torch.tensor(shifted, device=out.hidden.device),
                    out.hidden, out.aux, plan, _last_rows(layout))

    def begin_round(self, reqs, n):
        return self._carried(reqs)

    def _carried(self, reqs) -> tuple[torch.Tensor, torch.Tensor]:
        """The carry of `reqs`: states [L, H], logits [L, V]."""
        rids, last, logits = self._refilled
        if [r.id for r in reqs] == rids:  # the batch the last refill served, in its order:
            return last, logits  # its rows as they are (stacking [L, V] logits costs a copy)
        return (torch.stack([self.carry[r.id][0] for r in reqs]),
                torch.stack([self.carry[r.id][1] for r in reqs]))

    def step(self, reqs, n, s, tokens, state):
        # d_s goes to head index n + s - 1 (one left of its target index n + s).
        layout = self._layout(reqs, [1] * len(reqs), [m + s for m in n])
        return self.run(tokens, state, self.backend.plan(layout), k=s + 1)

    def accept(self, reqs, n, accepted, emitted, out, rows):
        if not reqs:
            return
        dev = out.hidden.device
        flat = torch.tensor([j for r in rows for j in r], device=dev)
        toks = torch.tensor([t for e, a in zip(emitted, accepted) for t in e[:a + 1]], device=dev)
        layout = self._layout(reqs, [a + 1 for a in accepted], [m + a + 1 for m, a in zip(n, accepted)])
        aux = None if out.aux is None else out.aux.index_select(0, flat)
        self.refill([r.id for r in reqs], toks, out.hidden.index_select(0, flat), aux,
                    self.backend.plan(layout), _last_rows(layout))

    def drop(self, rid):
        self.carry.pop(rid, None)


class MedusaDrafter(_HeadLogits, Drafter):
    """Medusa heads (a heads.DraftHead with `attends = False`): no KV cache, no token input.
    `feature[rid]`: the post-norm target feature f_t at the last accepted position t; head k
    maps it to x_{t+k+1}, so draft d_k of a round is head k on that one feature (the drafts
    do not depend on each other) and a round can have at most as many drafts as heads."""

    def __init__(self, head: nn.Module, device, dtype) -> None:
        self._setup(head, device, dtype)
        self.max_steps = head.cfg.num_steps
        self.feature: dict[int, torch.Tensor] = {}

    def run(self, tokens, state, plan, rows=None, k=1):
        _, feats = self.head.step(tokens, state, None, k=k)
        return state, self._logits(feats if rows is None else feats.index_select(0, rows))

    def _keep(self, reqs: list[Request], hidden: torch.Tensor) -> None:
        f = self.head.first_hidden(hidden, None)
        for j, r in enumerate(reqs):
            self.feature[r.id] = f[j]

    def prefill(self, reqs, layout, plan, pending, sampled, out):
        self._keep(reqs, out.hidden.index_select(
            0, torch.tensor(_last_rows(layout), device=out.hidden.device)))

    def begin_round(self, reqs, n):
        tokens = torch.tensor([r.token_ids[-1] for r in reqs], device=self.device)
        return self.run(tokens, torch.stack([self.feature[r.id] for r in reqs]), None, k=1)

    def step(self, reqs, n, s, tokens, state):
        return self.run(tokens, state, None, k=s + 1)

    def accept(self, reqs, n, accepted, emitted, out, rows):
        if reqs:
            self._keep(reqs, out.hidden.index_select(
                0, torch.tensor([r[-1] for r in rows], device=out.hidden.device)))

    def drop(self, rid):
        self.feature.pop(rid, None)


class LLMDrafter(Drafter):
    """A separate small LLM (same tokenizer) as draft, unshifted: its cache index j holds
    x_j. `cached[rid]` counts the positions whose draft KV is valid; `begin_round` first runs
    the tokens it has not seen (the bonus token, plus the last draft when all were accepted)."""

    def __init__(self, model: TransformerLM, num_pages: int, page_size: int, device, dtype) -> None:
        self.model = model.to(device=device, dtype=dtype).eval()
        self.device, self.page_size = torch.device(device), page_size
        a = model.arch
        self.cache = KVCache.for_arch(a, num_pages, page_size, dtype, device)
        self.cached: dict[int, int] = {}
        self.aux_layers: list[int] = []

    def use_cpu_blas(self, enabled: bool) -> None:
        set_cpu_blas(self.model, enabled, codes=self.weight_codes)

    def warm(self, rows):
        if not compilable(self.model):
            return
        if self.model.compiled is None:
            self.model.compiled = CompiledSteps(self.model)
        self.model.compiled.warm(rows)

    def run(self, tokens, state, plan, rows=None, k=1):
        return None, self.model(tokens, plan, self.cache, logits_indices=rows).logits

    def prefill(self, reqs, layout, plan, pending, sampled, out):
        # Its own plan: the draft's head counts and sizes may differ from the target's.
        ids = torch.tensor([t for p in pending for t in p], device=out.hidden.device)
        self.model(ids, self.backend.plan(layout), self.cache, compute_logits=False)
        for r, kv in zip(reqs, layout.kv_lens):
            self.cached[r.id] = kv

    def begin_round(self, reqs, n):
        toks = [r.token_ids[self.cached[r.id]:m + 1] for r, m in zip(reqs, n)]
        layout = self._layout(reqs, [len(t) for t in toks], [m + 1 for m in n])
        dev = self.device
        _, logits = self.run(torch.tensor([t for x in toks for t in x], device=dev), None,
                             self.backend.plan(layout), torch.tensor(_last_rows(layout), device=dev))
        for r, m in zip(reqs, n):
            self.cached[r.id] = m + 1
        return None, logits

    def step(self, reqs, n, s, tokens, state):
        layout = self._layout(reqs, [1] * len(reqs), [m + s + 1 for m in n])
        _, logits = self.run(tokens, None, self.backend.plan(layout))
        for r, m in zip(reqs, n):
            self.cached[r.id] = m + s + 1
        return None, logits

    def accept(self, reqs, n, accepted, emitted, out, rows):
        for r, a, m in zip(reqs, accepted, n):
            self.cached[r.id] = min(self.cached[r.id], m + a + 1)

    def drop(self, rid):
        self.cached.pop(rid, None)
