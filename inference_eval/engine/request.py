"""One generation request and its lifecycle state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from inference_eval.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """`num_cached`: tokens of `token_ids` whose K/V sit in this request's pages."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_context: int
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Per target forward that produced tokens for this request: drafts proposed / accepted
    # (autoregressive steps propose 0). len(...) = target steps; see spec/metrics.py.
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    # How many of those steps were prefills (the prompt, or its recompute after a
    # preemption): they verify nothing, so τ is taken over the other steps.
    prefill_steps: int = 0
    # Finished, but its last token still runs one step so its hidden state is captured
    # (LLMEngine with capture on; see inference_eval/engine/capture.py).
    draining: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def prefills(self, q_len: int) -> bool:
        """Whether a step feeding q_len tokens is this request's (re)computed prompt rather
        than a decode step (one token, or a verified chain, on a warm cache)."""
        return self.num_cached == 0 or q_len > 1

    @property
    def pending_ids(self) -> list[int]:
        """Tokens not yet in the cache: the whole prompt at prefill (plus outputs after a
        preemption), the last sampled token at decode."""
        return self.token_ids[self.num_cached:]

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error

    def check_stop(self, eos_ids: set[int]) -> bool:
        """Apply stop rules after a token was appended; returns True when finished."""
        p = self.params
        if not p.ignore_eos and self.output_ids and self.output_ids[-1] in eos_ids:
            self.finish("stop")
        elif len(self.output_ids) >= p.max_new_tokens:
            self.finish("length")
        elif self.num_tokens >= self.max_context:
            self.finish("context")
        return self.status is Status.FINISHED
