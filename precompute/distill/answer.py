"""The target answers batches of prompts, turn by turn, through the engine.

Turn t's prompt holds the target's own answers to turns < t, so a multi-turn conversation is
what the target would have said all along. Each conversation's next turn is queued as soon as
its answer ends, and (greedy) the next batch's prompts fill the steps a batch's last answers
leave free, so the engine runs full batches: waiting for every conversation's turn t before
any turn t + 1 left it running ~13 rows a step on average where it holds 64 (ShareGPT, all
turns, answers up to 256 tokens), under a fifth of its batch. A conversation stops early:
- at an answer cut by the token limit or the context (finish_reason "length"/"context"): it
  ends there with `truncated: true`, since a cut answer followed by the user's next turn is a
  dialogue that never happened;
- at a prompt that no longer fits the context, or an empty answer: it ends before that turn.
When that happens at the first turn there is nothing to learn, and the prompt is rejected
("prompt_too_long", "empty_answer", "generation_error").
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.prompt_encoding import encode_prompt
from inference_eval.engine.sampling import SamplingParams
from precompute.data import Conversation
from precompute.data.validate import EMPTY_ANSWER, GENERATION_ERROR, PROMPT_TOO_LONG

CUT = ("length", "context")  # finish reasons of an answer the target did not end itself


@dataclass
class _Dialogue:
    """One prompt on its way to a conversation."""

    prompt: Conversation
    messages: list[dict] = field(default_factory=list)  # system + answered (user, assistant)
    users: list[str] = field(default_factory=list)  # user turns still to answer
    open: bool = True
    truncated: bool = False
    tokens: int = 0
    reject: tuple[str, str] | None = None  # (reason, detail) when stopped at the first turn
    turn: int = 0  # the user turn asked next (or being answered)
    # The last answered turn: its prompt messages and GenerationResult (captured states).
    last: tuple[list[dict], object] | None = None

    def stop(self, reason: str, detail: str) -> None:
        self.open = False
        if not any(m["role"] == "assistant" for m in self.messages):
            self.reject = (reason, detail)


def _start(prompt: Conversation, turns: str) -> _Dialogue:
    msgs = prompt.to_messages()
    system = [m for m in msgs[:1] if m["role"] == "system"]
    users = [m["content"] for m in msgs if m["role"] == "user"]
    return _Dialogue(prompt, system, users[:1] if turns == "first" else users)


@dataclass
class _Batch:
    """One batch's dialogues: those not started yet (waiting), those not finished (live)."""

    first: int
    dialogues: list[_Dialogue]
    waiting: deque = field(init=False)
    live: int = field(init=False)

    def __post_init__(self) -> None:
        self.waiting = deque(self.dialogues)
        self.live = len(self.dialogues)

    def rows(self, source: str, keep_last: bool) -> tuple[int, list[dict], list[dict], dict]:
        kept, rejected, last = [], [], {}
        for d in self.dialogues:
            if d.reject is not None:
                rejected.append({"id": d.prompt.id, "reason": d.reject[0], "detail": d.reject[1],
                                 "generated_tokens": d.tokens})
            else:
                kept.append({"id": d.prompt.id, "messages": d.messages, "truncated": d.truncated,
                             "source": source, "generated_tokens": d.tokens})
                if keep_last:
                    last[d.prompt.id] = d.last
        return self.first, kept, rejected, last


def batch_seed(seed: int, first: int) -> int:
    """The generator seed of the batch starting at prompt `first`."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{first}".encode()).digest()[:8], "little")


def answer_batches(engine: LLMEngine, prompts: Sequence[Conversation],
                   batches: Sequence[tuple[int, Sequence[int]]], params: SamplingParams,
                   turns: str, source: str, seed: int, keep_last: bool = False
                   ) -> Iterator[tuple[int, list[dict], list[dict], dict]]:
    """Answer each batch (its first prompt index, the indices into `prompts`, Conversations
    of user turns, see data.load_prompts); yields (first, conversation rows {"id",
    "messages", "truncated", "source", "generated_tokens"}, reject rows {"id", "reason",
    "detail", "generated_tokens"}, last) per batch, in batch order, rows in prompt order;
    together the rows cover every prompt of the batch.

    turns: "first" or "all". source: the data source written into every conversation row.
    keep_last: fill `last` with id -> (prompt messages, GenerationResult) of each kept
    conversation's last answered turn (whose request holds the whole chat; with an engine
    that captures, its hidden states: precompute/capture.py); else it stays empty.
    seed: as a batch starts, the engine's generator is reseeded with batch_seed(seed, first).
    Greedy batches overlap (the next starts while the last answers of this one run: greedy
    answers do not depend on what shares a step); sampled ones run one at a time, so that a
    batch draws from its own seed whatever ran before it, and a resumed run draws what an
    uninterrupted one did.
    """
    if engine.cfg.compile and not engine.warmed:
        engine.warm(engine.cfg.max_batch_size)
    window = 2 if params.temperature == 0 else 1
    todo = deque(batches)
    running: deque[_Batch] = deque()
    asked: dict[int, tuple[_Dialogue, list[dict], _Batch]] = {}

    def ask(d: _Dialogue, b: _Batch) -> None:
        """Queue d's next turn, or close d (and count it done) when it has none to ask."""
        while d.open and d.turn < len(d.users):
            messages = d.messages + [{"role": "user", "content": d.users[d.turn]}]
            try:
                prompt_ids = encode_prompt(engine.tokenizer, messages, chat=True)
                if len(prompt_ids) >= engine.max_context:
                    d.stop(PROMPT_TOO_LONG, f"turn {d.turn}: the prompt has {len(prompt_ids)} "
                                            f"tokens, the engine's context holds "
                                            f"{engine.max_context}")
                    break
                req = engine.add_request(prompt_ids, params)
            except ValueError as exc:
                d.stop(GENERATION_ERROR, f"turn {d.turn}: {exc}")
                break
            asked[req.id] = (d, messages, b)
            return
        b.live -= 1

    def admit() -> None:
        """Start batches up to the window, then their dialogues while the engine has room."""
        while todo and len(running) < window and all(not b.waiting for b in running):
            first, batch = todo.popleft()
            engine.generator.manual_seed(batch_seed(seed, first))
            running.append(_Batch(first, [_start(prompts[i], turns) for i in batch]))
        sched = engine.scheduler
        for b in running:
            while b.waiting and len(sched.running) + len(sched.waiting) < engine.cfg.max_batch_size:
                ask(b.waiting.popleft(), b)

    while True:
        admit()
        while running and not running[0].waiting and running[0].live == 0:
            yield running.popleft().rows(source, keep_last)
        if not running and not todo:
            return
        for req in engine.step():
            d, messages, b = asked.pop(req.id)
            res = engine.result(req)
            d.tokens += len(res.token_ids)
            if res.error is not None:
                d.stop(GENERATION_ERROR, f"turn {d.turn}: {res.error}")
            elif not (res.text or "").strip():
                d.stop(EMPTY_ANSWER, f"turn {d.turn}: the answer is empty "
                                     f"({len(res.token_ids)} tokens, {res.finish_reason})")
            else:
                d.messages = messages + [{"role": "assistant", "content": res.text}]
                d.last = (messages, res)
                if res.finish_reason in CUT:
                    d.truncated = True
                    d.open = False
            d.turn += 1
            ask(d, b)
