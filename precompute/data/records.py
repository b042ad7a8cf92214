"""Data records shared by the loaders, the validator and the tokenizer.

A loader turns raw JSON into `Conversation`s (kept) and `Rejected`s (dropped, with a reason),
and fills one `LoadReport` that ends up in the shard manifest. Roles are normalized once, here,
so nothing downstream ever sees "human" or "gpt".
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

ROLES = ("system", "user", "assistant")

# ShareGPT dumps name the speakers after the product that answered; all of them are the model.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}


def normalize_role(raw: object) -> str | None:
    """Map a raw speaker name to "system" | "user" | "assistant"; None when unknown."""
    if not isinstance(raw, str):
        return None
    return ROLE_ALIASES.get(raw.strip().lower())


@dataclass
class Turn:
    """One message. `role` is normalized on construction; an unknown role raises ValueError."""

    role: str
    content: str

    def __post_init__(self) -> None:
        role = normalize_role(self.role)
        if role is None:
            raise ValueError(
                f"Turn.role {self.role!r} is not a known role; use one of {ROLES} "
                f"or an alias {sorted(ROLE_ALIASES)}"
            )
        self.role = role
        if not isinstance(self.content, str):
            raise TypeError(f"Turn.content must be str, got {type(self.content).__name__}")


@dataclass
class Conversation:
    """A validated conversation: optional leading system turn, then user/assistant turns.

    truncated: the last assistant turn was cut at a token limit (a self-distilled answer with
    finish_reason "length"), so no end-of-turn token is learned after it.
    A prompt record (`load_prompts`, for self-distillation) is a Conversation of user turns
    only, after the optional system turn: one user turn per answer to generate.
    """

    id: str
    turns: list[Turn]
    truncated: bool = False

    def to_messages(self) -> list[dict[str, str]]:
        """The turns as `[{"role", "content"}]`, the input of `apply_chat_template`."""
        return [{"role": t.role, "content": t.content} for t in self.turns]


@dataclass
class Rejected:
    """A record that was dropped. `reason` is one of validate.REJECT_REASONS."""

    id: str
    reason: str
    detail: str


@dataclass
class TokenizedRecord:
    """One conversation after the chat template, truncated to max_length.

    input_ids: list[int], length T <= max_length. loss_mask: list[int] of 0/1, length T; 1 on
    the tokens of assistant content and the end-of-turn token that closes each assistant turn
    (what the model must learn to emit), 0 on system/user text and template headers.
    truncated_tokens: tokens cut off the end to fit max_length.
    """

    id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated_tokens: int = 0

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class LoadReport:
    """What a load did, for logs and the shard manifest.

    kept: conversations returned. rejected: count per reason. notes: counts of repairs that did
    not reject a record (e.g. "dropped_leading_assistant", "merged_same_role"). records_seen:
    raw records looked at, skipped ones included. truncated_tail: the input ended inside a record
    (the embedded ShareGPT file does); tail_bytes_dropped / tail_chars_dropped: size of the
    partial record that was discarded.
    """

    source: str
    kept: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    records_seen: int = 0
    skipped: int = 0
    truncated_tail: bool = False
    tail_bytes_dropped: int = 0
    tail_chars_dropped: int = 0

    def add_rejected(self, rejected: Rejected) -> None:
        self.rejected[rejected.reason] = self.rejected.get(rejected.reason, 0) + 1

    def add_notes(self, notes: Counter | dict[str, int]) -> None:
        for key, n in notes.items():
            self.notes[key] = self.notes.get(key, 0) + n

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "kept": self.kept,
            "rejected": dict(sorted(self.rejected.items())),
            "notes": dict(sorted(self.notes.items())),
            "records_seen": self.records_seen,
            "skipped": self.skipped,
            "truncated_tail": self.truncated_tail,
            "tail_bytes_dropped": self.tail_bytes_dropped,
            "tail_chars_dropped": self.tail_chars_dropped,
        }


@dataclass
class LoadResult:
    """Output of every loader: kept conversations, rejected records and the report."""

    conversations: list[Conversation]
    rejected: list[Rejected]
    report: LoadReport


def write_rejects(path: str | Path, rejected: Iterable[Rejected]) -> int:
    """Write one JSON line `{"id", "reason", "detail"}` per rejected record; returns the count.

    Parent directories are created. The file is replaced, not appended to, so a rerun does not
    duplicate lines.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in rejected:
            f.write(json.dumps({"id": r.id, "reason": r.reason, "detail": r.detail}) + "\n")
            n += 1
    return n
