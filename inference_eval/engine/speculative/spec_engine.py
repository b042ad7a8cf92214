"""The speculative engine: chain drafting with an MTP/EAGLE head or a small LLM.

Shares everything with the autoregressive engine (scheduler, page allocator, block tables,
attention backend, sampling, generate API); only the step differs:

  prefill  (new or recomputed requests): target forward, sample x_n, then the drafter fills
           its cache for the prompt (a head from the target's hidden states).
  decode   (one round): draft K tokens -> the target verifies [x_n, d_1..d_K] in one pass ->
           accept a (lossless: verify_greedy / verify_sampled) -> emit d_1..d_a + 1 target
           token -> the drafter catches up (a head is refilled at positions n..n+a from the
           target's hidden states; an LLM draft runs the tokens it has not seen next round).

Per-request K shrinks near max_new_tokens and the context end, so a batch mixes draft lengths.
Target KV written past the accepted length is simply overwritten later (num_cached moves back).
"""
from __future__ import annotations

import time

import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.request import Request
from inference_eval.engine.sampling import SamplingTensors, processed_probs, sample, sample_from_probs
from inference_eval.engine.speculative.chain import verify_greedy, verify_sampled
from inference_eval.engine.speculative.drafters import HeadDrafter, LLMDrafter


class SpecEngine(LLMEngine):
    def __init__(self, model, tokenizer, cfg: EngineConfig | None, make_drafter, num_draft: int,
                 lookahead: int | None = None) -> None:
        """num_draft: the most draft tokens one round can accept (chain K, tree depth);
        lookahead: cache slots a round writes past the last token (default K + 1)."""
        if num_draft < 1:
            raise ValueError(f"draft.num_draft must be >= 1, got {num_draft}")
        super().__init__(model, tokenizer, cfg, lookahead=lookahead or num_draft + 1)
        if num_draft + 2 >= self.max_context:
            raise ValueError(f"draft.num_draft={num_draft} does not fit the context "
                             f"({self.max_context} tokens)")
        self.k = num_draft
        self.drafter = make_drafter(self.allocator.num_pages, self.cfg.page_size, self.device, self.dtype)
        if hasattr(self.drafter, "use_cpu_blas"):  # the draft's GEMMs take the target's path
            self.drafter.use_cpu_blas(self.cpu_blas)
        self.timing = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "catch_up": 0.0}

    # ---- helpers ------------------------------------------------------------------------
    def _tick(self, key: str, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.timing[key] += now - t0
        return now

    def _sub_layout(self, reqs: list[Request], q_lens: list[int], kv_lens: list[int]) -> BatchLayout:
        return BatchLayout(q_lens=q_lens, kv_lens=kv_lens, block_tables=[r.pages for r in reqs],
                           page_size=self.cfg.page_size)

    def _finish_or_keep(self, req: Request, done: list[Request]) -> bool:
        if req.check_stop(self.eos_ids):
            self.scheduler.free(req)
            self.drafter.drop(req.id)
            done.append(req)
            return True
        return False

    @staticmethod
    def _per_request(logits: torch.Tensor, cu: list[int], width: int) -> torch.Tensor:
        """Packed verify logits [T, V] -> [B, width, V], request i's rows first, zero padded."""
        out = logits.new_zeros(len(cu) - 1, width, logits.shape[-1])
        for i in range(len(cu) - 1):
            out[i, :cu[i + 1] - cu[i]] = logits[cu[i]:cu[i + 1]]
        return out

    def _target_probs(self, tgt: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """[B, N, V] target logits -> processed probabilities, each request's settings."""
        b, width, v = tgt.shape
        counts = torch.full((b,), width, device=self.device)
        return processed_probs(tgt.view(-1, v), st.repeat_interleave(counts)).view(b, width, v)

    def _emit(self, reqs: list[Request], ks: list[int], acc: list[int], emit: list[list[int]],
              n: list[int], done: list[Request]) -> list[int]:
        """Record a verified round (ks[i] proposed, acc[i] accepted, emit[i][:acc[i]+1] new
        tokens, target cache valid to n[i] + acc[i]); returns the indices still running."""
        keep = []
        for i, r in enumerate(reqs):
            r.proposed.append(ks[i])
            r.accepted.append(acc[i])
            for tok in emit[i][:acc[i] + 1]:
                r.output_ids.append(tok)
                if r.check_stop(self.eos_ids):
                    break
            r.num_cached = n[i] + acc[i] + 1
            if not self._finish_or_keep(r, done):
                keep.append(i)
        return keep

    # ---- the step -------------------------------------------------------------------------
    def _step(self) -> list[Request]:
        batch = self.scheduler.schedule()
        done = list(batch.failed)
        pre = [(r, q) for r, q in zip(batch.requests, batch.q_lens) if r.num_cached == 0 or q > 1]
        dec = [r for r, q in zip(batch.requests, batch.q_lens) if not (r.num_cached == 0 or q > 1)]
        if pre:
            self._prefill([r for r, _ in pre], [q for _, q in pre], done)
        if dec:
            self._decode(dec, done)
        if batch.requests:
            self.num_steps += 1
        return done

    def _prefill(self, reqs: list[Request], q_lens: list[int], done: list[Request]) -> None:
        t0 = time.perf_counter()
        layout = self._sub_layout(reqs, q_lens, [r.num_cached + q for r, q in zip(reqs, q_lens)])
        pending = [r.pending_ids for r in reqs]
        ids = torch.tensor([t for p in pending for t in p], dtype=torch.long, device=self.device)
        plan = self.backend.plan(layout)
        last = [c - 1 for c in layout.cu_q()[1:]]
        out = self.model(ids, plan, self.cache, logits_indices=torch.tensor(last, device=self.device),
                         aux_layers=self.drafter.aux_layers)
        st = SamplingTensors.from_params([r.params for r in reqs], self.device)
        sampled = sample(out.logits, st, self.generator).tolist()
        if isinstance(self.drafter, HeadDrafter):
            shifted = [t for p, s in zip(pending, sampled) for t in p[1:] + [s]]
            self.drafter.refill([r.id for r in reqs], torch.tensor(shifted, device=self.device),
                                out.hidden, out.aux, plan, last)
        else:
            self.drafter.forward(ids, self.backend.plan(layout), torch.tensor(last, device=self.device))
        for r, q, tok in zip(reqs, q_lens, sampled):
            r.num_cached += q
            if isinstance(self.drafter, LLMDrafter):
                self.drafter.cached[r.id] = r.num_cached
            r.output_ids.append(tok)
            r.proposed.append(0)
            r.accepted.append(0)
            self._finish_or_keep(r, done)
        self._tick("prefill", t0)

    def _draft_len(self, r: Request) -> int:
        left = r.params.max_new_tokens - len(r.output_ids) - 1
        room = self.max_context - r.num_cached - 2
        return max(0, min(self.k, left, room))

    def _decode(self, reqs: list[Request], done: list[Request]) -> None:
        t0 = time.perf_counter()
        st = SamplingTensors.from_params([r.params for r in reqs], self.device)
        greedy = st.all_greedy
        ks = [self._draft_len(r) for r in reqs]
        n = [r.num_cached for r in reqs]
        drafts, qs = self._propose(reqs, ks, n, st, greedy)
        t0 = self._tick("draft", t0)
        # Verify [x_n, d_1..d_k] of every request in one target pass.
        layout = self._sub_layout(reqs, [k + 1 for k in ks], [m + k + 1 for m, k in zip(n, ks)])
        ids = [r.token_ids[-1:] + d for r, d in zip(reqs, drafts)]
        plan = self.backend.plan(layout)
        out = self.model(torch.tensor([t for x in ids for t in x], device=self.device), plan,
                         self.cache, aux_layers=self.drafter.aux_layers)
        b, kmax, v = len(reqs), max(max(ks), 1), out.logits.shape[-1]
        cu = layout.cu_q()
        tgt = self._per_request(out.logits, cu, kmax + 1)
        dtok = torch.zeros(b, kmax, dtype=torch.long, device=self.device)
        for i, (k, d) in enumerate(zip(ks, drafts)):
            if k:
                dtok[i, :k] = torch.tensor(d, device=self.device)
        num = torch.tensor(ks, device=self.device)
        if greedy:
            acc, emit = verify_greedy(dtok, tgt, num)
        else:
            p = self._target_probs(tgt, st)
            q = torch.zeros(b, kmax, v, device=self.device)
            for i, rows in enumerate(qs):
                if rows:
                    q[i, :len(rows)] = torch.stack(rows)
            acc, emit = verify_sampled(dtok, q, p, num, self.generator)
        t0 = self._tick("verify", t0)
        acc, emit = acc.tolist(), emit.tolist()
        keep = self._emit(reqs, ks, acc, emit, n, done)
        self._catch_up([reqs[i] for i in keep], [acc[i] for i in keep], [emit[i] for i in keep],
                       [n[i] for i in keep], out, [range(cu[i], cu[i] + acc[i] + 1) for i in keep])
        self._tick("catch_up", t0)

    def _propose(self, reqs, ks, n, st, greedy):
        """Draft up to K tokens per request -> (tokens per request, draft probs per request)."""
        b = len(reqs)
        drafts: list[list[int]] = [[] for _ in range(b)]
        qs: list[list[torch.Tensor]] = [[] for _ in range(b)]
        live = [i for i in range(b) if ks[i] > 0]
        if not live:
            return drafts, qs
        if isinstance(self.drafter, HeadDrafter):
            hidden = torch.stack([self.drafter.carry[reqs[i].id][0] for i in live])
            logits = torch.stack([self.drafter.carry[reqs[i].id][1] for i in live])
        else:
            logits = self._llm_catch_up([reqs[i] for i in live], [n[i] for i in live])
        for s in range(1, max(ks) + 1):
            sub = SamplingTensors(st.temperature[live], st.top_k[live], st.top_p[live])
            if greedy:
                tok = logits.argmax(-1)
            else:
                probs = processed_probs(logits, sub)
                tok = sample_from_probs(probs, self.generator)
            for j, i in enumerate(live):
                drafts[i].append(int(tok[j]))
                if not greedy:
                    qs[i].append(probs[j])
            nxt = [j for j, i in enumerate(live) if ks[i] > s]
            if not nxt:
                break
            live = [live[j] for j in nxt]
            rs = [reqs[i] for i in live]
            layout = BatchLayout([1] * len(live), [n[i] + s + (0 if isinstance(self.drafter, HeadDrafter) else 1)
                                                   for i in live], [r.pages for r in rs], self.cfg.page_size)
            toks = tok[nxt]
            if isinstance(self.drafter, HeadDrafter):
                hidden, logits = self.drafter.run(toks, hidden[nxt], self.backend.plan(layout))
            else:
                logits = self.drafter.forward(toks, self.backend.plan(layout),
                                              torch.arange(len(live), device=self.device))
                for i in live:
                    self.drafter.cached[reqs[i].id] = n[i] + s + 1
        return drafts, qs

    def _llm_catch_up(self, reqs: list[Request], n: list[int]) -> torch.Tensor:
        """Run the tokens an LLM draft has not seen (up to and incl. x_n); logits for d_1."""
        seen = [self.drafter.cached[r.id] for r in reqs]
        toks = [r.token_ids[c:m + 1] for r, c, m in zip(reqs, seen, n)]
        layout = BatchLayout([len(t) for t in toks], [m + 1 for m in n], [r.pages for r in reqs],
                             self.cfg.page_size)
        last = torch.tensor([c - 1 for c in layout.cu_q()[1:]], device=self.device)
        logits = self.drafter.forward(torch.tensor([t for x in toks for t in x], device=self.device),
                                      self.backend.plan(layout), last)
        for r, m in zip(reqs, n):
            self.drafter.cached[r.id] = m + 1
        return logits

    def _catch_up(self, reqs, acc, emit, n, out, rows) -> None:
        """After acceptance: refill a head's cache at n..n+a from the target's hidden states
        (its own drafted entries are less accurate), or trim an LLM draft's valid prefix.
        rows[i]: the a+1 rows of the verify output holding request i's accepted tokens."""
        if not reqs:
            return
        if isinstance(self.drafter, LLMDrafter):
            for r, a, m in zip(reqs, acc, n):
                self.drafter.cached[r.id] = min(self.drafter.cached[r.id], m + a + 1)
            return
        rows = torch.tensor([j for r in rows for j in r], device=self.device)
        toks = torch.tensor([t for e, a in zip(emit, acc) for t in e[:a + 1]], device=self.device)
        layout = self._sub_layout(reqs, [a + 1 for a in acc], [m + a + 1 for m, a in zip(n, acc)])
        aux = None if out.aux is None else out.aux.index_select(0, rows)
        last = [c - 1 for c in layout.cu_q()[1:]]
        self.drafter.refill([r.id for r in reqs], toks, out.hidden.index_select(0, rows), aux,
                            self.backend.plan(layout), last)

