"""The inference engine: requests in, tokens out, over a paged KV cache.

A step is: schedule -> lay out the batch -> plan attention once -> run the model -> sample
-> update requests. Speculative schemes (inference_eval/engine/speculative/) reuse the same scheduler,
allocator, cache and plan objects.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from inference_eval.engine.attention import BatchLayout, make_backend
from inference_eval.engine.capture import CaptureSpec, HiddenCapture
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.compiled import CompiledSteps
from inference_eval.engine.model.cuda_graphs import CudaGraphs
from inference_eval.engine.model.linear import openblas_threads, set_cpu_blas
from inference_eval.engine.model.transformer import TransformerLM
from inference_eval.engine.page_allocator import PageAllocator
from inference_eval.engine.prompt_encoding import encode_prompt
from inference_eval.engine.request import Request, Status
from inference_eval.engine.sampling import SamplingParams, SamplingTensors, sample
from inference_eval.engine.scheduler import ScheduledBatch, Scheduler
from inference_eval.engine.threads import torch_threads


@dataclass
class GenerationResult:
    id: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    # With capture on (LLMEngine(capture=...)): states of prompt_ids + token_ids, hidden [L, H]
    # pre final norm, aux [L, A, H] or None (inference_eval/engine/capture.py).
    hidden: torch.Tensor | None = None
    aux: torch.Tensor | None = None


class LLMEngine:
    def __init__(self, model: TransformerLM, tokenizer=None, cfg: EngineConfig | None = None,
                 lookahead: int = 0, capture: CaptureSpec | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        # capture: keep every processed row's hidden states per request (self-distillation).
        self.capture = HiddenCapture(capture) if capture is not None else None
        self.model, self.tokenizer = model, tokenizer
        arch = model.arch
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.cpu_blas = self.cfg.cpu_blas == "numpy" or (
            self.cfg.cpu_blas == "auto" and self.device.type == "cpu" and self.dtype == torch.float32)
        set_cpu_blas(model, self.cpu_blas, codes=self.cfg.weight_codes)
        if self.cfg.compile and model.compiled is None:  # shared by every engine of the model
            model.compiled = CompiledSteps(model)
        self.lookahead, self.warmed = lookahead, False
        self.max_context = min(arch.max_position_embeddings, self.cfg.max_context or 1 << 62)
        num_pages = self.cfg.resolve_num_pages(KVCache.bytes_per_token_for_arch(arch, self.dtype))
        self.allocator = PageAllocator(num_pages, self.cfg.page_size)
        self.cache = KVCache.for_arch(arch, num_pages, self.cfg.page_size, self.dtype, self.device)
        self.backend = make_backend(self.cfg.attention, self.device, self.dtype)
        if self.cfg.cuda_graphs and self.backend.name == "flashinfer":
            self.backend.graphs = CudaGraphs(self.backend)
        self.scheduler = Scheduler(self.allocator, self.cfg.max_batch_size,
                                   self.cfg.max_batched_tokens, lookahead)
        self.eos_ids = set(arch.eos_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(self.cfg.seed)
        self._next_id = 0
        self.num_steps = 0
        # Seconds per phase of generate()'s steps; a step with any prompt in it is a prefill.
        self.timing = {"prefill": 0.0, "decode": 0.0}

    # ---- requests -------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a tokenized prompt. Bad prompts raise ValueError naming the request."""
        rid = self._next_id
        self._next_id += 1
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError(f"request {rid}: the prompt is empty")
        if len(ids) >= self.max_context:
            raise ValueError(f"request {rid}: prompt has {len(ids)} tokens, the context holds "
                             f"{self.max_context}; shorten the prompt or raise engine.max_context")
        bad = [t for t in ids if not 0 <= t < self.model.arch.vocab_size]
        if bad:
            raise ValueError(f"request {rid}: token ids {bad[:5]} are outside the vocabulary")
        req = Request(rid, ids, params, self.max_context)
        self.scheduler.add(req)
        return req

    def warm(self, batch_size: int = 1) -> None:
        """With engine.compile: compile the step sizes `batch_size` requests use, so none
        is compiled inside a timed run: every row count up to batch_size x rows per round
        when that is at most 5, else 1, the batch size and the full count (steps of other
        sizes run eagerly). generate() warms for its first batch itself."""
        if not self.cfg.compile:
            return
        n = batch_size * max(1, self.lookahead)  # a round verifies `lookahead` rows
        self.warm_rows(range(1, n + 1) if n <= 5 else sorted({1, batch_size, n}))
        self.warmed = True

    def warm_rows(self, rows: Sequence[int]) -> None:
        self.model.compiled.warm(rows)

    # ---- one step ----------------------------------------------------------------------
    def layout(self, batch: ScheduledBatch) -> BatchLayout:
        return BatchLayout(q_lens=batch.q_lens,
                           kv_lens=[r.num_cached + q for r, q in zip(batch.requests, batch.q_lens)],
                           block_tables=[r.pages for r in batch.requests],
                           page_size=self.cfg.page_size)

    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests that finished in it."""
        with self.step_threads(), torch.inference_mode():
            return self._step()

    @contextmanager
    def step_threads(self):
        """The thread setting every step runs under (benchmarks time steps under it too):
        linear.openblas_threads, 1 where OpenBLAS runs some of the step's products."""
        with torch_threads(openblas_threads(self.cpu_blas)):
            yield

    def _step(self) -> list[Request]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        done = list(batch.failed)
        if not batch.requests:
            return done
        phase = "prefill" if any(r.prefills(q) for r, q in zip(batch.requests, batch.q_lens)) \
            else "decode"
        layout = self.layout(batch)
        ids = torch.tensor([t for r in batch.requests for t in r.pending_ids], dtype=torch.long,
                           device=self.device)
        plan = self.backend.plan(layout)
        last = torch.tensor(layout.cu_q()[1:], device=self.device) - 1
        aux_layers = self.capture.aux_layers if self.capture is not None else ()
        out = self.model(ids, plan, self.cache, logits_indices=last, aux_layers=aux_layers)
        st = SamplingTensors.from_params([r.params for r in batch.requests], self.device)
        tokens = sample(out.logits, st, self.generator).tolist()
        self.num_steps += 1
        if self.capture is not None:
            self._capture_rows(batch, out)
        for req, q, tok in zip(batch.requests, batch.q_lens, tokens):
            if req.draining:  # the finished request's last token, run for its state only
                req.num_cached += q
                req.draining = False
                req.status = Status.FINISHED
                self.scheduler.free(req)
                done.append(req)
                continue
            req.prefill_steps += req.prefills(q)
            req.num_cached += q
            req.output_ids.append(tok)
            req.proposed.append(0)
            req.accepted.append(0)
            if req.check_stop(self.eos_ids):
                if self.capture is not None and req.error is None:
                    req.status, req.draining = Status.RUNNING, True  # one more row to capture
                    continue
                self.scheduler.free(req)
                done.append(req)
        self.timing[phase] += time.perf_counter() - t0  # .tolist() above synchronized
        return done

    def _capture_rows(self, batch: ScheduledBatch, out) -> None:
        start = 0
        for req, q in zip(batch.requests, batch.q_lens):
            aux = None if out.aux is None else out.aux[start:start + q]
            self.capture.add(req.id, req.num_cached, out.hidden[start:start + q], aux)
            start += q

    # ---- batch API ----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams],
                 chat: bool = True, progress: bool = True) -> list[GenerationResult]:
        """Generate for many prompts with continuous batching.

        prompts: strings (chat template applied when chat=True), message lists
        ([{"role", "content"}]), or token id lists. A prompt that fails validation gets a
        result with `error` set; the others still run.
        """
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if self.cfg.compile and not self.warmed:
            self.warm(min(len(prompts), self.cfg.max_batch_size))
        results: dict[int, GenerationResult] = {}
        live: dict[int, tuple[int, Request]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                ids = encode_prompt(self.tokenizer, prompt, chat=chat)
                req = self.add_request(ids, p)
                live[req.id] = (i, req)
            except ValueError as exc:
                results[i] = GenerationResult(i, [], [], finish_reason="error",
                                              error=f"prompt {i}: {exc}")
        bar = tqdm(total=len(live), desc="generate", unit="req", disable=not progress)
        t0, ntok = time.perf_counter(), 0
        while self.scheduler.has_work:
            for req in self.step():
                i, _ = live[req.id]
                results[i] = self.result(req, i)
                ntok += len(req.output_ids)
                bar.update(1)
                bar.set_postfix(tok_s=f"{ntok / max(time.perf_counter() - t0, 1e-9):.1f}")
        bar.close()
        return [results[i] for i in range(len(prompts))]

    def result(self, req: Request, i: int = 0) -> GenerationResult:
        """A finished request (one step() returned) as the result of prompt i; its captured
        states, if any, go with it."""
        text = None
        if self.tokenizer is not None and req.output_ids:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        hidden, aux = self.capture.pop(req.id) if self.capture is not None else (None, None)
        return GenerationResult(i, req.prompt_ids, list(req.output_ids), text, req.finish_reason,
                                req.error, req.num_preemptions, hidden=hidden, aux=aux,
                                meta={"target_steps": len(req.accepted), "proposed": list(req.proposed),
                                      "accepted": list(req.accepted),
                                      "prefill_steps": req.prefill_steps})
