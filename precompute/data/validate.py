"""Turn raw JSON records into `Conversation`s or `Rejected`s, one rule per reason.

A record is rejected (the whole record, never a single turn, so a dialogue is never spliced):

| reason               | when                                                              |
|----------------------|-------------------------------------------------------------------|
| "invalid_json"       | a JSONL line does not parse (set by the loader, not here)         |
| "not_an_object"      | the record, or one of its turns, is not a JSON object; or it has  |
|                      | neither a "conversations" nor a "messages" list                   |
| "missing_role"       | a turn has no "from"/"role" key, or it is null                    |
| "unknown_role"       | a turn's role is not system/user/assistant or a known alias       |
| "non_string_content" | a turn's "value"/"content" is missing or not a string (OpenAI      |
|                      | content parts that are all {"type": "text"} are joined instead)   |
| "empty_turn"         | a turn's content is empty or whitespace only                      |
| "no_assistant_turn"  | after the repairs below, no assistant turn is left                |
| "too_short"          | after tokenization and truncation no token has loss_mask 1        |
|                      | (set by chat_template.tokenize_conversations)                     |
| "non_bool_truncated" | the record's "truncated" flag is present but not true/false       |

Repairs that keep the record, each counted in `LoadReport.notes`:
- "dropped_leading_assistant": assistant turns before the first user turn are dropped (about a
  third of ShareGPT starts with "gpt": the human opener was lost when the dump was split).
  There is no prompt for them to answer, so learning them would teach the head to talk first.
- "dropped_inner_system": a system turn after the first non-system turn is dropped; several
  chat templates (Gemma, Mistral) refuse them and ShareGPT has none.
- "merged_same_role": consecutive turns of the same role are joined with "\\n\\n" (ShareGPT
  splits long answers into several "gpt" turns). Templates such as Mistral's raise on
  non-alternating roles, and merging keeps all the assistant text.
- "dropped_trailing_user": user turns after the last assistant turn carry no loss, only cost.
- "duplicate_id": the id was seen before in this load (the record is kept; ids are labels).

Prompt records (`validate_prompt_record`, the input of self-distillation, precompute/distill/)
are `{"prompt": str}`, or `{"messages"|"conversations": [...]}` whose user turns are the prompts
(assistant turns are ignored, counted in the note "ignored_assistant_turns"; user turns with no
assistant turn between them are merged). They share the turn rules above, plus:

| reason               | when                                                              |
|----------------------|-------------------------------------------------------------------|
| "no_user_turn"       | the record has no user turn to answer                             |
| "duplicate_id"       | the id was seen before in this load (answers are keyed by id)     |
| "prompt_too_long"    | the chat-templated prompt does not fit the engine's context       |
|                      | (set by the distill stage)                                        |
| "empty_answer"       | the target's first answer is empty (set by the distill stage)     |
| "generation_error"   | the engine refused the request (set by the distill stage)         |

Records without a usable id (a non-empty string or an integer) get "{source_name}:{index}",
where index is the 0-based position in a JSON array / dataset, or the 1-based line in JSONL.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from .records import (
    Conversation,
    LoadReport,
    LoadResult,
    Rejected,
    TokenizedRecord,
    Turn,
    normalize_role,
)

INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_ROLE = "missing_role"
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
EMPTY_TURN = "empty_turn"
NO_ASSISTANT_TURN = "no_assistant_turn"
TOO_SHORT = "too_short"
NON_BOOL_TRUNCATED = "non_bool_truncated"
NO_USER_TURN = "no_user_turn"
DUPLICATE_ID = "duplicate_id"
PROMPT_TOO_LONG = "prompt_too_long"
EMPTY_ANSWER = "empty_answer"
GENERATION_ERROR = "generation_error"

REJECT_REASONS = (
    INVALID_JSON,
    NOT_AN_OBJECT,
    MISSING_ROLE,
    UNKNOWN_ROLE,
    NON_STRING_CONTENT,
    EMPTY_TURN,
    NO_ASSISTANT_TURN,
    TOO_SHORT,
    NON_BOOL_TRUNCATED,
    NO_USER_TURN,
    DUPLICATE_ID,
    PROMPT_TOO_LONG,
    EMPTY_ANSWER,
    GENERATION_ERROR,
)

_SAME_ROLE_JOINER = "\n\n"


def record_id(obj: object, index: int, source_name: str) -> str:
    """The record's own id when usable, else "{source_name}:{index}"."""
    if isinstance(obj, dict):
        rid = obj.get("id")
        if isinstance(rid, str) and rid.strip():
            return rid
        if isinstance(rid, int) and not isinstance(rid, bool):
            return str(rid)
    return f"{source_name}:{index}"


def _content_text(content: object) -> str | None:
    """A turn's text; OpenAI-style all-text content parts are joined. None if not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                return None
            if not isinstance(part.get("text"), str):
                return None
            parts.append(part["text"])
        return "".join(parts)
    return None


def _parse_turns(raw_turns: list, rid: str) -> list[Turn] | Rejected:
    """Check every turn's fields; the first bad turn rejects the record."""
    turns = []
    for k, t in enumerate(raw_turns):
        if not isinstance(t, dict):
            return Rejected(rid, NOT_AN_OBJECT, f"turn {k} is {type(t).__name__}, not an object")
        # Arrow-backed datasets fill absent struct fields with None, so fall back on None.
        raw_role = t.get("from") if t.get("from") is not None else t.get("role")
        if raw_role is None:
            return Rejected(rid, MISSING_ROLE, f"turn {k} has no 'from' or 'role'")
        role = normalize_role(raw_role)
        if role is None:
            return Rejected(rid, UNKNOWN_ROLE, f"turn {k} has role {raw_role!r}")
        raw_content = t.get("value") if t.get("value") is not None else t.get("content")
        content = _content_text(raw_content)
        if content is None:
            return Rejected(
                rid,
                NON_STRING_CONTENT,
                f"turn {k} ({role}) content is {type(raw_content).__name__}, not a string",
            )
        if not content.strip():
            return Rejected(rid, EMPTY_TURN, f"turn {k} ({role}) is empty")
        turns.append(Turn(role, content))
    return turns


def _repair(turns: list[Turn], notes: Counter) -> list[Turn]:
    """Apply the documented repairs: leading system kept, then user-first alternation."""
    system = [t for t in turns[:1] if t.role == "system"]
    rest = turns[len(system):]
    # Several leading system turns become one (the merge below handles them).
    while rest and rest[0].role == "system":
        system.append(rest.pop(0))

    inner_system = sum(t.role == "system" for t in rest)
    if inner_system:
        notes["dropped_inner_system"] += inner_system
        rest = [t for t in rest if t.role != "system"]

    first_user = next((k for k, t in enumerate(rest) if t.role == "user"), len(rest))
    if first_user and any(t.role == "assistant" for t in rest[:first_user]):
        notes["dropped_leading_assistant"] += 1
    rest = rest[first_user:]

    merged: list[Turn] = []
    for t in system + rest:
        if merged and merged[-1].role == t.role:
            merged[-1] = Turn(t.role, merged[-1].content + _SAME_ROLE_JOINER + t.content)
            notes["merged_same_role"] += 1
        else:
            merged.append(Turn(t.role, t.content))

    if merged and merged[-1].role == "user":
        notes["dropped_trailing_user"] += 1
        merged.pop()
    return merged


def _raw_turns(obj: dict, rid: str, need: str) -> list | Rejected:
    """The record's turn list ('conversations', else 'messages'), or a Rejected saying `need`."""
    raw_turns = obj.get("conversations")
    if raw_turns is None:
        raw_turns = obj.get("messages")
    if not isinstance(raw_turns, list):
        return Rejected(rid, NOT_AN_OBJECT,
                        f"{need}, got {type(raw_turns).__name__} (keys: {sorted(obj)[:8]})")
    return raw_turns


def validate_record(
    obj: object, *, index: int, source_name: str, notes: Counter
) -> Conversation | Rejected:
    """Validate and repair one raw record.

    obj: a decoded JSON value, ShareGPT `{"id", "conversations": [{"from", "value"}]}` or
    OpenAI `{"messages": [{"role", "content"}]}` (either key style works in either list).
    notes: repair counters, updated in place. Returns a Conversation or a Rejected.
    """
    rid = record_id(obj, index, source_name)
    if not isinstance(obj, dict):
        return Rejected(rid, NOT_AN_OBJECT, f"record is {type(obj).__name__}, not an object")
    raw_turns = _raw_turns(obj, rid, "record needs a 'conversations' or 'messages' list")
    if isinstance(raw_turns, Rejected):
        return raw_turns
    # Arrow-backed datasets fill an absent column with None: None reads as "not truncated".
    truncated = obj.get("truncated") if obj.get("truncated") is not None else False
    if not isinstance(truncated, bool):
        return Rejected(rid, NON_BOOL_TRUNCATED, f"'truncated' is {truncated!r}, not true/false")
    turns = _parse_turns(raw_turns, rid)
    if isinstance(turns, Rejected):
        return turns
    local = Counter()
    turns = _repair(turns, local)
    if not any(t.role == "assistant" for t in turns):
        return Rejected(
            rid, NO_ASSISTANT_TURN, f"no assistant turn after a user turn ({len(raw_turns)} turns)"
        )
    notes.update(local)
    return Conversation(rid, turns, truncated=truncated)


def validate_prompt_record(
    obj: object, *, index: int, source_name: str, notes: Counter
) -> Conversation | Rejected:
    """Validate one prompt record for self-distillation: the user turns the target answers.

    obj: `{"prompt": str}`, or a chat record as in `validate_record` whose assistant turns are
    ignored. Returns a Conversation of an optional system turn then user turns only (one per
    answer to generate), or a Rejected.
    """
    rid = record_id(obj, index, source_name)
    if not isinstance(obj, dict):
        return Rejected(rid, NOT_AN_OBJECT, f"record is {type(obj).__name__}, not an object")
    if obj.get("prompt") is not None:
        raw_turns: object = [{"role": "user", "content": obj["prompt"]}]
    else:
        raw_turns = _raw_turns(obj, rid, "a prompt record needs a 'prompt' string or a "
                                         "'conversations' or 'messages' list")
        if isinstance(raw_turns, Rejected):
            return raw_turns
    turns = _parse_turns(raw_turns, rid)
    if isinstance(turns, Rejected):
        return turns
    local = Counter()
    system = [t for t in turns[:1] if t.role == "system"]
    users: list[Turn] = []
    answered = True  # an assistant turn (or the start) came before this user turn
    for t in turns[len(system):]:
        if t.role == "assistant":
            local["ignored_assistant_turns"] += 1
            answered = True
        elif t.role == "system":
            local["dropped_inner_system"] += 1
        elif users and not answered:
            users[-1] = Turn("user", users[-1].content + _SAME_ROLE_JOINER + t.content)
            local["merged_same_role"] += 1
        else:
            users.append(t)
            answered = False
    if not users:
        return Rejected(rid, NO_USER_TURN, f"no user turn to answer ({len(raw_turns)} turns)")
    notes.update(local)
    return Conversation(rid, system + users)


def check_tokenized(record: TokenizedRecord, max_length: int) -> Rejected | None:
    """"too_short" when truncation left no loss-masked token (nothing to learn), else None."""
    if record.num_loss_tokens == 0:
        where = (
            f"first assistant token is past max_length={max_length}"
            if record.truncated_tokens
            else "no assistant token after the chat template"
        )
        return Rejected(record.id, TOO_SHORT, f"{len(record.input_ids)} tokens kept; {where}")
    return None


def collect(
    records: Iterable[tuple[int, object]],
    *,
    source_name: str,
    report: LoadReport,
    skip: int = 0,
    limit: int | None = None,
    prompts: bool = False,
) -> LoadResult:
    """Validate a stream of `(index, raw_record)` pairs into a LoadResult.

    A raw record may already be a `Rejected` (the loader's "invalid_json"). The first `skip`
    records are passed over unvalidated, so a held-out split stays the same records whatever
    the rules; `limit` caps the kept conversations and stops reading the stream.
    prompts: validate prompt records (`validate_prompt_record`); a repeated id is then
    rejected as "duplicate_id" instead of noted, since answers are keyed by id.
    """
    validate = validate_prompt_record if prompts else validate_record
    conversations: list[Conversation] = []
    rejected: list[Rejected] = []
    notes: Counter = Counter()
    seen_ids: set[str] = set()
    for index, obj in records:
        report.records_seen += 1
        if report.records_seen <= skip:
            report.skipped += 1
            continue
        result = obj if isinstance(obj, Rejected) else validate(
            obj, index=index, source_name=source_name, notes=notes
        )
        if prompts and not isinstance(result, Rejected) and result.id in seen_ids:
            result = Rejected(result.id, DUPLICATE_ID, f"record {index} repeats an earlier id")
        if isinstance(result, Rejected):
            rejected.append(result)
            report.add_rejected(result)
            continue
        if result.id in seen_ids:
            notes["duplicate_id"] += 1
        seen_ids.add(result.id)
        conversations.append(result)
        report.kept += 1
        if limit is not None and report.kept >= limit:
            break
    report.add_notes(notes)
    return LoadResult(conversations, rejected, report)
