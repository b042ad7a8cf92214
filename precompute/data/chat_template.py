"""Render a conversation with the tokenizer's chat template and mark what the model must learn.

The loss mask is 1 on assistant content plus the end-of-turn marker that closes each assistant
turn (`<|im_end|>` in ChatML, `<|eot_id|>` in Llama 3), and 0 on everything else, template
headers such as `<|im_start|>assistant\\n` included. Without the marker in the mask a draft head
never learns to predict the end of an answer, and acceptance collapses at every turn end.

How the assistant spans are found, for any template (worked on ChatML):

    P_i = render(turns[:i], add_generation_prompt=True)  ...<|im_start|>assistant\\n
    Q_i = render(turns[:i+1])                            ...<|im_start|>assistant\\nHi!<|im_end|>\\n
    span_i = [len(P_i), len(Q_i.rstrip()))                                   Hi!<|im_end|>

valid when the template is prefix-stable (Q_i starts with P_i and the full render starts with
Q_i). The trailing newline is left out: it is template glue the next header owns. A template
that is not prefix-stable (one that rewrites earlier turns, e.g. strips reasoning) falls back
to finding each assistant content verbatim in the full render, left to right, extended by the
end-of-turn marker read off a two-turn probe render.

A conversation marked `truncated` (its last answer was cut at a token limit) ends that last
span at the answer's content: the template still renders an end-of-turn marker after it, but
the target never emitted one there, so teaching the head to predict it would be teaching a
false stop.

Tokens are then taken from ONE tokenization of the full render (offsets mapping), so the ids
are exactly what `apply_chat_template(..., tokenize=True)` gives, and a token is masked when its
characters overlap a span. Truncation to max_length cuts ids and mask together.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import islice
from typing import Iterable, Iterator

from .records import Conversation, LoadReport, Rejected, TokenizedRecord
from .validate import check_tokenized

_PROBE_USER = "Q7f3x"
_PROBE_ASSISTANT = "A9k2z"


def _render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def end_of_turn_marker(tokenizer) -> str:
    """Text the template puts right after an assistant message, trailing whitespace removed.

    "<|im_end|>" for ChatML, "<|eot_id|>" for Llama 3, "" for a template with no marker.
    Only used by the fallback path; the prefix path reads the marker off each render.
    """
    rendered = _render(
        tokenizer,
        [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ],
    )
    k = rendered.rfind(_PROBE_ASSISTANT)
    if k < 0:
        return ""
    return rendered[k + len(_PROBE_ASSISTANT):].rstrip()


def _prefix_span(tokenizer, messages: list[dict], i: int, full: str) -> tuple[int, int] | None:
    """Span of assistant turn i from prefix renders; None when the template is not prefix-stable."""
    before = _render(tokenizer, messages[:i], add_generation_prompt=True)
    through = _render(tokenizer, messages[: i + 1])
    if not (through.startswith(before) and full.startswith(through)):
        return None
    start, end = len(before), len(through.rstrip())
    # A template may trim the content, never replace it; if it did, the span is not the answer.
    if messages[i]["content"].strip() not in through[start:end]:
        return None
    return start, end


def assistant_char_spans(
    tokenizer, messages: list[dict], full: str, *, record_id: str, stop_at: int | None = None,
    open_last: bool = False,
) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant turn (content + end-of-turn) in `full`.

    messages: the turns as `apply_chat_template` takes them; full: their complete render.
    stop_at: skip turns starting at or after this character (they fall past max_length).
    open_last: the last message is an answer cut at a token limit; its span stops at its
    content (no end-of-turn marker).
    Raises ValueError naming the record when an assistant turn cannot be located.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    marker: str | None = None
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            # Step past this turn's text, so the fallback cannot match a short answer ("4")
            # inside the question that precedes it.
            k = full.find(m["content"].strip(), cursor)
            cursor = cursor if k < 0 else k + len(m["content"].strip())
            continue
        span = _prefix_span(tokenizer, messages, i, full) if i > 0 else None
        if span is None:
            content = m["content"].strip()
            k = full.find(content, cursor)
            if k < 0:
                raise ValueError(
                    f"record {record_id}: the chat template does not render assistant turn {i} "
                    "verbatim, so its loss mask cannot be placed; use a template that keeps "
                    "assistant content as given"
                )
            if marker is None:
                marker = end_of_turn_marker(tokenizer)
            end = k + len(content)
            if marker and full.startswith(marker, end):
                end += len(marker)
            span = (k, end)
        if open_last and i == len(messages) - 1:
            span = (span[0], _content_end(full, m["content"], span))
        if stop_at is not None and span[0] >= stop_at:
            break
        spans.append(span)
        cursor = span[1]
    return spans


def _content_end(full: str, content: str, span: tuple[int, int]) -> int:
    """End of an answer's content inside its span, the end-of-turn marker left out: all of
    it when the template renders it verbatim (a cut answer's trailing space is the target's
    output too), else its stripped text."""
    if full.startswith(content, span[0]):
        return span[0] + len(content)
    text = content.strip()
    k = full.rfind(text, span[0], span[1])
    return span[1] if k < 0 else k + len(text)


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters [s, e) overlap a span.

    offsets: per-token (start, end), non-decreasing as fast tokenizers emit them. Bisection
    keeps this O(spans * log T) instead of a Python loop over every token.
    """
    starts = [o[0] for o in offsets]
    ends = [o[1] for o in offsets]
    mask = [0] * len(offsets)
    for a, b in spans:
        first = bisect_right(ends, a)  # first token ending after the span starts
        last = bisect_left(starts, b)  # first token starting at or after the span ends
        mask[first:last] = [1] * max(0, last - first)
    return mask


def _check_fast(tokenizer) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"{type(tokenizer).__name__} is a slow tokenizer; the loss mask needs character "
            "offsets, which only fast (Rust) tokenizers provide: load it with use_fast=True"
        )


def _render_conversation(
    tokenizer, conv: Conversation, system_prompt: str | None
) -> tuple[list[dict], str]:
    """(messages, full render) with the optional system prompt inserted."""
    messages = conv.to_messages()
    if system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    try:
        return messages, _render(tokenizer, messages)
    except Exception as e:  # jinja raises TemplateError, templates raise their own messages
        raise ValueError(
            f"record {conv.id}: the chat template failed on this conversation: {e}"
        ) from e


def _masked_record(
    tokenizer, conv_id: str, messages: list[dict], full: str, enc, max_length: int,
    open_last: bool = False,
) -> TokenizedRecord:
    """Truncate one encoding of `full` and mask it (open_last: see assistant_char_spans)."""
    input_ids = list(enc["input_ids"])
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    truncated = max(0, len(input_ids) - max_length)
    input_ids, offsets = input_ids[:max_length], offsets[:max_length]
    stop_at = offsets[-1][1] if truncated and offsets else None
    spans = assistant_char_spans(tokenizer, messages, full, record_id=conv_id, stop_at=stop_at,
                                 open_last=open_last)
    return TokenizedRecord(
        conv_id, input_ids, _mask_from_offsets(offsets, spans), truncated_tokens=truncated
    )


def tokenize_conversation(
    tokenizer, conv: Conversation, max_length: int, system_prompt: str | None = None
) -> TokenizedRecord:
    """Chat-template, tokenize and loss-mask one conversation.

    tokenizer: a fast Hugging Face tokenizer with a chat template (offsets are needed).
    system_prompt: inserted as the first turn when the conversation has no system turn.
    Returns TokenizedRecord with input_ids / loss_mask of length T = min(rendered, max_length).
    The mask may be all zeros (see validate.check_tokenized for the "too_short" rule).
    """
    _check_fast(tokenizer)
    messages, full = _render_conversation(tokenizer, conv, system_prompt)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    return _masked_record(tokenizer, conv.id, messages, full, enc, max_length, conv.truncated)


def tokenize_conversations(
    tokenizer,
    conversations: Iterable[Conversation],
    max_length: int,
    system_prompt: str | None = None,
    *,
    report: LoadReport | None = None,
    rejected: list[Rejected] | None = None,
    batch_size: int = 64,
) -> Iterator[TokenizedRecord]:
    """Tokenize a stream in order, dropping "too_short" records; same output as a loop of
    `tokenize_conversation`, but each batch is tokenized in one call (Rust threads).

    Each drop is appended to `rejected` and counted in `report` (kept is decremented, so the
    report keeps describing what reaches the shards).
    """
    _check_fast(tokenizer)
    it = iter(conversations)
    while batch := list(islice(it, batch_size)):
        rendered = [_render_conversation(tokenizer, c, system_prompt) for c in batch]
        encs = tokenizer(
            [full for _, full in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
        for k, (conv, (messages, full)) in enumerate(zip(batch, rendered)):
            enc = {"input_ids": encs["input_ids"][k], "offset_mapping": encs["offset_mapping"][k]}
            record = _masked_record(tokenizer, conv.id, messages, full, enc, max_length,
                                    conv.truncated)
            problem = check_tokenized(record, max_length)
            if problem is not None:
                if rejected is not None:
                    rejected.append(problem)
                if report is not None:
                    report.add_rejected(problem)
                    report.kept -= 1
                continue
            yield record
