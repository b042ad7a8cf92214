"""Continuous batching of prefill and decode under a KV-page budget.

Each step: running requests decode first (oldest first); when pages run out the youngest
running request is preempted (pages freed, recomputed later from its tokens, so outputs
stay exact); waiting requests are then admitted FIFO while pages and the token budget last.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from inference_eval.engine.page_allocator import PageAllocator
from inference_eval.engine.request import Request, Status


@dataclass
class ScheduledBatch:
    """requests[b] gets q_lens[b] new tokens this step (its `pending_ids`)."""

    requests: list[Request]
    q_lens: list[int]
    failed: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_batch_size: int = 64,
                 max_batched_tokens: int = 4096, lookahead: int = 0) -> None:
        self.allocator = allocator
        self.max_batch_size, self.max_batched_tokens = max_batch_size, max_batched_tokens
        # Extra slots each running request keeps free (draft tokens verified next step).
        self.lookahead = lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        need = self.allocator.pages_for(min(req.max_context,
                                            len(req.prompt_ids) + 1 + self.lookahead))
        if need > self.allocator.num_pages:
            raise ValueError(
                f"request {req.id}: its prompt needs {need} KV pages but the cache holds only "
                f"{self.allocator.num_pages}; raise engine.num_pages or shorten the prompt")
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        need = self.allocator.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        req.pages.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages, req.num_cached = [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def free(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []
        if req in self.running:
            self.running.remove(req)

    def schedule(self) -> ScheduledBatch:
        reqs, q_lens = [], []
        preempted = False
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue
            n = len(req.pending_ids)
            while not self._reserve(req, req.num_cached + n + self.lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                reqs.append(req)
                q_lens.append(n)
        budget = self.max_batched_tokens - sum(q_lens)
        while self.waiting and not preempted and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            n = len(req.pending_ids)
            if reqs and n > budget:
                break
            if not self._reserve(req, n + self.lookahead):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            reqs.append(req)
            q_lens.append(n)
            budget -= n
        failed = []
        if not reqs and self.waiting and not self.running:
            # Alone with an empty cache and still no room: it can never run. Fail it, not the batch.
            req = self.waiting.popleft()
            req.finish("error", f"request {req.id} needs {self.allocator.pages_for(req.num_tokens + 1)}"
                       f" KV pages, the cache has {self.allocator.num_pages}; raise engine.num_pages")
            failed.append(req)
        return ScheduledBatch(reqs, q_lens, failed)
