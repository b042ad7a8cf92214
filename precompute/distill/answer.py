"""The target answers one batch of prompts, turn by turn, through the engine.

Turn t of every conversation in the batch is one `LLMEngine.generate` call (continuous
batching), and turn t's prompt holds the target's own answers to turns < t, so a multi-turn
conversation is what the target would have said all along. A conversation stops early:
- at an answer cut by the token limit or the context (finish_reason "length"/"context"): it
  ends there with `truncated: true`, since a cut answer followed by the user's next turn is a
  dialogue that never happened;
- at a prompt that no longer fits the context, or an empty answer: it ends before that turn.
When that happens at the first turn there is nothing to learn, and the prompt is rejected
("prompt_too_long", "empty_answer", "generation_error").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

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


def answer_batch(engine: LLMEngine, prompts: Sequence[Conversation], params: SamplingParams,
                 turns: str, source: str, last: dict | None = None
                 ) -> tuple[list[dict], list[dict]]:
    """Answer `prompts` (Conversations of user turns, see data.load_prompts).

    turns: "first" or "all". source: the data source written into every conversation row.
    last: when given, filled with id -> (prompt messages, GenerationResult) of each kept
    conversation's last answered turn (whose request holds the whole chat; with an engine
    that captures, its hidden states: precompute/capture.py).
    Returns (conversation rows {"id", "messages", "truncated", "source", "generated_tokens"},
    reject rows {"id", "reason", "detail", "generated_tokens"}), each in prompt order.
    """
    dialogues = [_start(p, turns) for p in prompts]
    t = 0
    while live := [d for d in dialogues if d.open and t < len(d.users)]:
        asked, ids = [], []
        for d in live:
            messages = d.messages + [{"role": "user", "content": d.users[t]}]
            try:
                prompt_ids = encode_prompt(engine.tokenizer, messages, chat=True)
            except ValueError as exc:
                d.stop(GENERATION_ERROR, f"turn {t}: {exc}")
                continue
            if len(prompt_ids) >= engine.max_context:
                d.stop(PROMPT_TOO_LONG, f"turn {t}: the prompt has {len(prompt_ids)} tokens, "
                                        f"the engine's context holds {engine.max_context}")
                continue
            asked.append((d, messages))
            ids.append(prompt_ids)
        results = engine.generate(ids, params, chat=True, progress=False) if ids else []
        for (d, messages), res in zip(asked, results):
            d.tokens += len(res.token_ids)
            if res.error is not None:
                d.stop(GENERATION_ERROR, f"turn {t}: {res.error}")
            elif not (res.text or "").strip():
                d.stop(EMPTY_ANSWER, f"turn {t}: the answer is empty "
                                     f"({len(res.token_ids)} tokens, {res.finish_reason})")
            else:
                d.messages = messages + [{"role": "assistant", "content": res.text}]
                d.last = (messages, res)
                if res.finish_reason in CUT:
                    d.truncated = True
                    d.open = False
        t += 1
    kept, rejected = [], []
    for d in dialogues:
        if d.reject is not None:
            rejected.append({"id": d.prompt.id, "reason": d.reject[0], "detail": d.reject[1],
                             "generated_tokens": d.tokens})
        else:
            kept.append({"id": d.prompt.id, "messages": d.messages, "truncated": d.truncated,
                         "source": source, "generated_tokens": d.tokens})
            if last is not None:
                last[d.prompt.id] = d.last
    return kept, rejected
