"""Self-distillation inputs: prompt-only records in every form answered, multi-turn answers
built on the target's own earlier answers, sampled answers reproducible, bad records counted
by reason (the tiny chat target of distill_helpers)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import precompute.distill.run as distill_run
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.prompt_encoding import encode_prompt
from inference_eval.engine.target import load_tokenizer
from inference_eval.hydra_app import compose
from precompute.data import DataConfig, load_prompts
from precompute.distill import DistillConfig
from distill_helpers import IM_END, chat_target, distill_cfg, rows, shared_targets  # noqa: F401


# ------------------------------------------------------------------------ prompt-only inputs


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


PROMPT_FORMS = {
    "prompt": [{"id": "p0", "prompt": "Why is the sky blue?"},
               {"id": "p1", "prompt": "Name a prime number."}],
    "messages": [{"id": "m0", "messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Why is the sky blue?"}]},
                 {"id": "m1", "messages": [{"role": "user", "content": "Name a prime."},
                                           {"role": "user", "content": "A small one."}]}],
    "sharegpt": [{"id": "s0", "conversations": [
        {"from": "human", "value": "Why is the sky blue?"},
        {"from": "gpt", "value": "Rayleigh scattering."},
        {"from": "human", "value": "And sunsets?"},
        {"from": "gpt", "value": "Longer paths."}]}],
}
WANT_TURNS = {
    "p0": [("user", "Why is the sky blue?")], "p1": [("user", "Name a prime number.")],
    "m0": [("system", "Be brief."), ("user", "Why is the sky blue?")],
    "m1": [("user", "Name a prime.\n\nA small one.")],
    "s0": [("user", "Why is the sky blue?"), ("user", "And sunsets?")],
}


@pytest.mark.parametrize("form", sorted(PROMPT_FORMS))
def test_prompt_only_inputs_are_answered(form, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / f"{form}.jsonl", PROMPT_FORMS[form])
    loaded = load_prompts(DataConfig(source="jsonl", path=str(data)))
    assert not loaded.rejected
    assert {c.id: [(t.role, t.content) for t in c.turns] for c in loaded.conversations} == \
        {rid: WANT_TURNS[rid] for rid in (r["id"] for r in PROMPT_FORMS[form])}

    asked = []
    add_request = LLMEngine.add_request

    def spy(self, prompt_ids, *a, **k):
        asked.append(list(prompt_ids))
        return add_request(self, prompt_ids, *a, **k)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    out = tmp_path / "out"
    m = distill_run.main(distill_cfg(data, out, "turns=all", "sampling.max_new_tokens=4",
                                     f"target.arch.eos_token_ids=[{IM_END}]"))
    convs = rows(out / "conversations.jsonl")
    assert [c["id"] for c in convs] == [r["id"] for r in PROMPT_FORMS[form]]
    assert m.counts["kept"] == len(convs) and all(c["truncated"] for c in convs)
    tok = load_tokenizer(distill_cfg(data, out).target)
    for c in convs:
        # Turn 1 was cut, so the conversation ends after it even when a turn 2 exists.
        *prompt, answer = c["messages"]
        first_user = [r for r, _ in WANT_TURNS[c["id"]]].index("user") + 1
        assert [(t["role"], t["content"]) for t in prompt] == WANT_TURNS[c["id"]][:first_user]
        assert answer["role"] == "assistant" and answer["content"]
        assert encode_prompt(tok, prompt, chat=True) in asked


def test_turn_two_sees_the_targets_own_first_answer(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "two.jsonl", PROMPT_FORMS["sharegpt"])
    asked = []
    add_request = LLMEngine.add_request

    def spy(self, prompt_ids, *a, **k):
        asked.append(list(prompt_ids))
        return add_request(self, prompt_ids, *a, **k)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    out = tmp_path / "out"
    # Every 11th token ends an answer: in 64 tokens turn 1 ends by itself.
    distill_run.main(distill_cfg(data, out, "turns=all", "sampling.max_new_tokens=64"))
    (conv,) = rows(out / "conversations.jsonl")
    u1, a1, u2, a2 = conv["messages"]
    assert (u1["content"], u2["content"]) == ("Why is the sky blue?", "And sunsets?")
    assert a1["content"] != "Rayleigh scattering." and not conv["truncated"]
    tok = load_tokenizer(distill_cfg(data, out).target)
    assert asked[1] == encode_prompt(tok, [u1, a1, u2], chat=True)

    first_only = tmp_path / "first"
    # turns=first, the default
    distill_run.main(distill_cfg(data, first_only, "sampling.max_new_tokens=64"))
    (conv,) = rows(first_only / "conversations.jsonl")
    assert conv["messages"] == [u1, a1]


def test_sampled_answers_are_reproducible_batch_by_batch(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Question {i}?"}
                                              for i in range(6)])
    answers = {}
    for name, extra in (("greedy", []), ("hot", ["sampling.temperature=1.0"]),
                        ("hot_again", ["sampling.temperature=1.0"])):
        m = distill_run.main(distill_cfg(data, tmp_path / name, *extra))
        answers[name] = [c["messages"][-1]["content"]
                         for c in rows(tmp_path / name / "conversations.jsonl")]
        assert m.sampling["temperature"] == (1.0 if extra else 0.0)
    assert answers["hot"] == answers["hot_again"] != answers["greedy"]


# ------------------------------------------------------------------------ bad records


BAD_PROMPTS = [  # (raw JSONL line, reason, id in rejects.jsonl)
    ('{"id": "cut", "prompt": "Why', "invalid_json", "cut"),
    ("[1, 2]", "not_an_object", "bad.jsonl:3"),
    ('{"id": "norole", "messages": [{"content": "hi"}]}', "missing_role", "norole"),
    ('{"id": "alien", "conversations": [{"from": "martian", "value": "hi"}]}', "unknown_role",
     "alien"),
    ('{"id": "num", "prompt": 5}', "non_string_content", "num"),
    ('{"id": "blank", "prompt": "   "}', "empty_turn", "blank"),
    ('{"id": "mute", "messages": [{"role": "assistant", "content": "hello"}]}', "no_user_turn",
     "mute"),
    ('{"id": "ok0", "prompt": "Say it again."}', "duplicate_id", "ok0"),
    (json.dumps({"id": "long", "prompt": "word " * 300}), "prompt_too_long", "long"),
]


def test_bad_prompt_records_are_counted_by_reason(tmp_path):
    good = [json.dumps({"id": f"ok{i}", "prompt": f"Question {i}?"}) for i in range(3)]
    data = write_jsonl(tmp_path / "bad.jsonl", good[:1] + [b[0] for b in BAD_PROMPTS] + good[1:])
    out = tmp_path / "out"
    m = distill_run.main(distill_cfg(data, out, "engine.max_context=128"))
    assert m.counts["rejected"] == {reason: 1 for _, reason, _ in BAD_PROMPTS}
    assert m.counts["kept"] == 3 and m.data["load_report"]["kept"] == 4  # "long" loads
    got = sorted((r["id"], r["reason"]) for r in rows(out / "rejects.jsonl"))
    assert got == sorted((rid, reason) for _, reason, rid in BAD_PROMPTS)
    assert all(r["detail"] for r in rows(out / "rejects.jsonl"))
    assert [c["id"] for c in rows(out / "conversations.jsonl")] == ["ok0", "ok1", "ok2"]


def test_empty_answers_are_rejected(tmp_path):
    # The tied tiny target only repeats the prompt's last token, "\n": every answer is blank.
    data = write_jsonl(tmp_path / "p.jsonl", PROMPT_FORMS["prompt"])
    out = tmp_path / "out"
    cfg = compose("distill", DistillConfig, ["target=tiny", "data=jsonl", f"data.path={data}",
                                             "sampling.max_new_tokens=4", "progress=false",
                                             f"output_dir={out}"])
    m = distill_run.main(cfg)
    assert m.counts["rejected"] == {"empty_answer": 2} and m.counts["kept"] == 0
    assert m.generated_tokens == 8
