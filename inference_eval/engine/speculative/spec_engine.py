"""The speculative engine: chain drafting with any `Drafter` (an MTP/EAGLE or Medusa head, a
small LLM); the engine calls the drafter's verbs and never knows which one it holds.

Shares everything with the autoregressive engine (scheduler, page allocator, block tables,
attention backend, sampling, generate API); only the step differs:

  prefill  (new or recomputed requests): target forward, sample x_n, then `drafter.prefill`
           (a head fills its cache for the prompt from the target's hidden states).
  decode   (one round): draft K tokens (`begin_round`, then `step` K-1 times, the engine
           sampling each) -> the target verifies [x_n, d_1..d_K] in one pass -> accept a
           (lossless: verify_greedy / verify_sampled) -> emit d_1..d_a + 1 target token ->
           `drafter.accept` (a head is refilled at positions n..n+a from the target's hidden
           states; an LLM draft trims its valid prefix and runs the unseen tokens next round).

Per-request K shrinks near max_new_tokens and the context end, so a batch mixes draft lengths.
Target KV written past the accepted length is simply overwritten later (num_cached moves back).

Per-round meta: proposed[s] = drafts the target judged, accepted[s] = drafts emitted. A round
that stops on an EOS among its drafts counts only the drafts up to it in both: the drafts
after it were never emitted, so they are neither accepted nor rejected.
"""
from __future__ import annotations

import itertools
import time

import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.request import Request
from inference_eval.engine.sampling import SamplingTensors, processed_probs, sample, sample_from_probs
from inference_eval.engine.speculative.chain import verify_greedy, verify_sampled
from inference_eval.engine.speculative.draft_cut import DraftCut


class _VerifyRows:
    """Where a round's packed verify rows sit in its padded [B, kmax + 1] tables (request i
    has ks[i] + 1 rows: x_n, then its drafts): flat [T] indices into the table, num_draft [B]
    and the first packed row of each request, starts [B]; all on the device."""

    def __init__(self, ks: list[int], kmax: int, device) -> None:
        flat = [i * (kmax + 1) + j for i, k in enumerate(ks) for j in range(k + 1)]
        self.full = len(flat) == len(ks) * (kmax + 1)  # every request has kmax drafts
        self.flat = torch.tensor(flat, device=device)
        self.num_draft = torch.tensor(ks, device=device)
        self.starts = torch.tensor([0, *itertools.accumulate(k + 1 for k in ks)][:-1], device=device)

    def pick(self, table: torch.Tensor) -> torch.Tensor:
        """[B, kmax + 1] -> the packed rows' entries [T] (a view when every row is kept)."""
        return table.reshape(-1) if self.full else table.reshape(-1).index_select(0, self.flat)


class SpecEngine(LLMEngine):
    k_key = "draft.num_draft"  # the config key of max_accepted, for errors

    def __init__(self, model, tokenizer, cfg: EngineConfig | None, make_drafter, max_accepted: int,
                 lookahead: int | None = None, min_confidence: float = 0.0,
                 confidence_cut: str = "draft", round_costs: list[float] | None = None) -> None:
        """make_drafter(num_pages, page_size, device, dtype) -> a Drafter on the engine's pages;
        max_accepted: the most draft tokens one round can accept (chain K, tree depth; the
        config key is draft.num_draft or draft.depth); lookahead: cache slots a round writes
        past the last token (default K + 1); min_confidence: a request's chain stops at the
        first draft whose confidence (its law's largest probability, or the drafter's own)
        is below it (0: never); confidence_cut "prefix": at the first whose product with the
        round's confidences before it is below it; "rate": at the first that does not raise
        the round's expected tokens per cost (round_costs[s]: a round of s drafts, in AR
        steps); the rules: engine/speculative/draft_cut.py."""
        if max_accepted < 1:
            raise ValueError(f"draft.num_draft must be >= 1, got {max_accepted}")
        self.cut = DraftCut(confidence_cut, min_confidence, round_costs, max_accepted)
        super().__init__(model, tokenizer, cfg, lookahead=lookahead or max_accepted + 1)
        if max_accepted + 2 >= self.max_context:
            raise ValueError(f"draft.num_draft={max_accepted} does not fit the context "
                             f"({self.max_context} tokens)")
        self.max_accepted = max_accepted
        self.drafter = make_drafter(self.allocator.num_pages, self.cfg.page_size, self.device, self.dtype)
        if self.drafter.max_steps is not None and max_accepted > self.drafter.max_steps:
            key = self.k_key
            raise ValueError(f"{key}={max_accepted} is more than the {self.drafter.max_steps} "
                             "draft positions this drafter has (a Medusa checkpoint's heads, a "
                             f"block drafter's block): set {key} <= {self.drafter.max_steps}")
        self.timing = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "catch_up": 0.0}
        self.counters = {"rounds": 0, "host_syncs": 0}  # device-to-host reads per round
        self._rows_seen: dict[tuple, _VerifyRows] = {}
        self.drafter.bind(self.backend, self.cpu_blas, self.cfg.weight_codes, self.cfg.head_code,
                          self.counters)

    def warm_rows(self, rows) -> None:
        """Verification passes return the drafter's aux layers; the drafter compiles too."""
        self.model.compiled.warm(rows, tuple(self.drafter.aux_layers))
        self.drafter.warm(rows)

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
        """Packed verify logits [T, V] -> [B, width, V], request i's rows first, zero padded
        (a view when every request has `width` rows: batch 1, a copy of ~1 MB spared a round)."""
        if cu[-1] == (len(cu) - 1) * width:
            return logits.view(len(cu) - 1, width, logits.shape[-1])
        out = logits.new_zeros(len(cu) - 1, width, logits.shape[-1])
        for i in range(len(cu) - 1):
            out[i, :cu[i + 1] - cu[i]] = logits[cu[i]:cu[i + 1]]
        return out

    def _target_probs(self, tgt: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """[B, N, V] target logits -> processed probabilities, each request's settings."""
        b, width, v = tgt.shape
        counts = torch.full((b,), width, device=self.device)
        return processed_probs(tgt.view(-1, v), st.repeat_interleave(counts)).view(b, width, v)

    def _record_round(self, reqs: list[Request], proposed: list[int], acc: list[int],
                      emit: list[list[int]], n: list[int], done: list[Request]) -> list[int]:
        """Append a verified round to each request (proposed[i] drafts judged, acc[i]
        accepted, emit[i][:acc[i]+1] new tokens, target cache valid to n[i] + acc[i]) and
        finish the requests that stop; returns the indices still running. A stop on a draft
        (an EOS) cuts both counts to the drafts emitted."""
        keep = []
        for i, r in enumerate(reqs):
            took = 0
            for tok in emit[i][:acc[i] + 1]:
                r.output_ids.append(tok)
                took += 1
                if r.check_stop(self.eos_ids):
                    break
            cut = took <= acc[i]  # stopped on draft `took`: the rest were never emitted
            r.proposed.append(took if cut else proposed[i])
            r.accepted.append(took if cut else acc[i])
            r.num_cached = n[i] + acc[i] + 1
            if not self._finish_or_keep(r, done):
                keep.append(i)
        return keep

    # ---- the step -------------------------------------------------------------------------
    def _step(self) -> list[Request]:
        batch = self.scheduler.schedule()
        done = list(batch.failed)
        for r in batch.failed:  # preempted earlier, it may have drafter state
            self.drafter.drop(r.id)
        pre = [(r, q) for r, q in zip(batch.requests, batch.q_lens) if r.prefills(q)]
        dec = [r for r, q in zip(batch.requests, batch.q_lens) if not r.prefills(q)]
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
        self.drafter.prefill(reqs, layout, plan, pending, sampled, out)
        for r, q, tok in zip(reqs, q_lens, sampled):
            r.num_cached += q
            r.output_ids.append(tok)
            r.prefill_steps += 1
            r.proposed.append(0)
            r.accepted.append(0)
            self._finish_or_keep(r, done)
        self._tick("prefill", t0)

    def _draft_len(self, r: Request) -> int:
        left = r.params.max_new_tokens - len(r.output_ids) - 1
        room = self.max_context - r.num_cached - 2
        return max(0, min(self.max_accepted, left, room))

    def _decode(self, reqs: list[Request], done: list[Request]) -> None:
        """One round. Drafts stay on the device until the round's one host synchronisation
        (accepted lengths, emitted tokens and drafts fetched together). A drafter that can
        (`sync_free`) catches up before it, on the verify pass's own layout and plan."""
        t0 = time.perf_counter()
        st = SamplingTensors.from_params([r.params for r in reqs], self.device)
        greedy = st.all_greedy
        n = [r.num_cached for r in reqs]
        ks = self.drafter.draft_lengths(reqs, n, [self._draft_len(r) for r in reqs])
        b, kmax = len(reqs), max(max(ks), 1)
        cut = self.cut.begin(b)
        dtok, qs, ks = self._propose(reqs, ks, n, st, greedy, kmax, cut)
        t0 = self._tick("draft", t0)
        # Verify [x_n, d_1..d_k] of every request in one target pass.
        layout = self._sub_layout(reqs, [k + 1 for k in ks], [m + k + 1 for m, k in zip(n, ks)])
        cu = layout.cu_q()
        rows = self._rows(ks, kmax)
        last = torch.tensor([[r.token_ids[-1]] for r in reqs], device=self.device)
        ids = rows.pick(torch.cat([last, dtok], 1))
        plan = self.backend.plan(layout)
        out = self.model(ids, plan, self.cache, aux_layers=self.drafter.aux_layers)
        v = out.logits.shape[-1]
        tgt = self._per_request(out.logits, cu, kmax + 1)
        num = rows.num_draft
        if greedy:
            acc_t, emit_t = verify_greedy(dtok, tgt, num)
        else:
            p = self._target_probs(tgt, st)
            q = torch.zeros(b, kmax, v, device=self.device)
            for i, rows in enumerate(qs):
                if rows:
                    q[i, :len(rows)] = torch.stack(rows)
            acc_t, emit_t = verify_sampled(dtok, q, p, num, self.generator)
        t0 = self._tick("verify", t0)
        caught_up = False
        if self.drafter.sync_free:
            # Row j of request i is followed by emit[i, j] wherever it is kept (j <= accepted:
            # the accepted draft, then the correction or bonus); later rows are overwritten
            # before anyone reads them, so any valid id does.
            row_tokens = rows.pick(emit_t.clamp(min=0))
            last_rows = rows.starts + acc_t
            self.drafter.verified(reqs, plan, row_tokens, out, last_rows)
            caught_up = True
            t0 = self._tick("catch_up", t0)
        fetched = torch.cat([acc_t.unsqueeze(1), emit_t, dtok], 1).tolist()  # the one sync
        self.counters["host_syncs"] += 1
        self.counters["rounds"] += 1
        acc = [row[0] for row in fetched]
        emit = [row[1:kmax + 2] for row in fetched]
        self.cut.end(cut, acc)
        keep = self._record_round(reqs, ks, acc, emit, n, done)
        if not caught_up:
            self.drafter.accept([reqs[i] for i in keep], [n[i] for i in keep],
                                [acc[i] for i in keep], [emit[i] for i in keep], out,
                                [range(cu[i], cu[i] + acc[i] + 1) for i in keep])
        self._tick("catch_up", t0)

    def _rows(self, ks: list[int], kmax: int) -> "_VerifyRows":
        """The verify rows' index tensors for these draft lengths, made once per (ks, kmax):
        a run repeats a few shapes (batch 1: one per K), so a round builds none."""
        key = (tuple(ks), kmax)
        got = self._rows_seen.get(key)
        if got is None:
            if len(self._rows_seen) >= 1024:  # many batch mixes: start over, never grow unbounded
                self._rows_seen.clear()
            got = self._rows_seen[key] = _VerifyRows(ks, kmax, self.device)
        return got

    def _propose(self, reqs, ks, n, st, greedy, kmax, cut):
        """Draft up to ks[i] tokens per request -> (drafts [B, kmax] int64 on the device, 0
        past the request's drafts; draft probs per request: the processed distribution each
        draft was drawn from, empty when greedy; the drafts each request has). Nothing is
        read back to the host here, except each step's confidences when a cut is set
        (`cut`: this round's state of self.cut): a request whose draft the rule refuses
        keeps only the drafts before that one (the cut depends on the draft alone, so
        verification stays lossless)."""
        b, ks = len(reqs), list(ks)
        dtok = torch.zeros(b, kmax, dtype=torch.long, device=self.device)
        qs: list[list[torch.Tensor]] = [[] for _ in range(b)]
        live = [i for i in range(b) if ks[i] > 0]
        if not live:
            return dtok, qs, ks
        state, logits = self.drafter.begin_round([reqs[i] for i in live], [n[i] for i in live])
        for s in range(1, max(ks) + 1):
            probs = None
            if not greedy:
                sub = SamplingTensors(st.temperature[live], st.top_k[live], st.top_p[live])
                probs = processed_probs(logits, sub)
            sure = self._confident(logits, live, cut)
            tok = logits.argmax(-1) if greedy else sample_from_probs(probs, self.generator)
            for j, i in enumerate(live):
                if not sure[j]:
                    ks[i] = s - 1
                elif probs is not None:
                    qs[i].append(probs[j])
            kept = [j for j in range(len(live)) if sure[j]]
            if len(kept) == b:  # every request drafts on (the usual case): no index tensors
                dtok[:, s - 1] = tok
            elif kept:
                src = tok if len(kept) == len(live) else tok[torch.tensor(kept, device=self.device)]
                dtok[torch.tensor([live[j] for j in kept], device=self.device), s - 1] = src
            nxt = [j for j, i in enumerate(live) if sure[j] and ks[i] > s]
            if not nxt:
                break
            if len(nxt) < len(live):
                live = [live[j] for j in nxt]
                sel = torch.tensor(nxt, device=self.device)
                state = None if state is None else state.index_select(0, sel)
                tok = tok.index_select(0, sel)
            state, logits = self.drafter.step([reqs[i] for i in live], [n[i] for i in live], s,
                                              tok, state)
        return dtok, qs, ks

    def _confident(self, logits: torch.Tensor, live: list[int], cut) -> list[bool]:
        """Per row of one draft step (logits [L, V], row j of request live[j]): whether the
        cut keeps the draft (draft_cut.py). The confidence is the draft model's own law's top
        probability, before any sampling setting, or, for a drafter with a learned confidence
        head, the head's predicted acceptance. The same test for greedy and sampled requests,
        so a request's cuts do not depend on its batch; it reads the draft side only
        (lossless)."""
        if not self.cut.active:
            return [True] * len(live)
        self.counters["host_syncs"] += 1
        top = self.drafter.confidence()
        if top is None:
            top = torch.softmax(logits.float(), -1).max(-1).values
        return self.cut.keep(cut, live, top.tolist())
