"""The self-distillation stage (`python -m precompute.distill`): the tiny random target answers
prompts through the engine; answers are cached, resumable after SIGKILL, and read by
precompute with the truncated flag honoured.

The tiny target here has its own lm_head (tied random embeddings only ever repeat the last
token, "\\n", so every answer would be empty) and every 11th token id as an end-of-sequence
token, so some answers end by themselves and others are cut at max_new_tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kill_point import run_until

import precompute.distill.run as distill_run
import precompute.run as precompute_run
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.prompt_encoding import encode_prompt
from inference_eval.engine.target import load_target, load_tokenizer
from inference_eval.hydra_app import CONF_DIR, compose
from precompute.config import PrecomputeConfig
from precompute.data import DataConfig, load_prompts
from precompute.distill import DistillConfig
from precompute.shard_io import read_shard

REPO = Path(__file__).resolve().parents[2]
# One BLAS/OpenMP thread per process, as in the precompute job tests (conftest.JOB_ENV).
JOB_ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

IM_END = 2  # SmolLM2's <|im_end|>
TINY: list[str] = []  # the overrides selecting that target; filled by `chat_target`
STAGE = ["data=jsonl", "engine.max_batch_size=4", "sampling.max_new_tokens=12", "progress=false"]


@pytest.fixture(scope="module", autouse=True)
def chat_target(tmp_path_factory):
    """conf/target/tiny.yaml as `tiny_chat` with that lm_head and those end tokens, in a config
    dir of its own on Hydra's search path (4,469 ids parse in ms from YAML, in seconds as an
    override)."""
    conf = tmp_path_factory.mktemp("conf")
    node = yaml.safe_load((CONF_DIR / "target" / "tiny.yaml").read_text())
    node["name"] = "tiny_chat"
    node["arch"].update(tie_word_embeddings=False, eos_token_ids=list(range(0, 49152, 11)))
    (conf / "target").mkdir()
    (conf / "target" / "tiny_chat.yaml").write_text(yaml.safe_dump(node))
    TINY[:] = [f"hydra.searchpath=[file://{conf}]", "target=tiny_chat"]


def distill_argv(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "precompute.distill", *TINY, *STAGE, f"data.path={data}",
            f"output_dir={out}", *extra]


def distill_cfg(data: Path, out: Path, *extra: str) -> DistillConfig:
    return compose("distill", DistillConfig, [*TINY, *STAGE, f"data.path={data}",
                                              f"output_dir={out}", *extra])


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())
            if p.is_file()}


def no_generation(*_a, **_k):
    raise AssertionError("nothing should be generated here")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=REPO, env=JOB_ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(autouse=True)
def shared_targets(monkeypatch):
    """Each random target built once per module: in-process runs skip 3 s of init each."""
    for module in (distill_run, precompute_run):
        monkeypatch.setattr(module, "load_target", _cached_load_target)


_TARGETS: dict[str, object] = {}


def _cached_load_target(cfg, **kwargs):
    key = repr((cfg, sorted(kwargs.items())))
    if key not in _TARGETS:
        _TARGETS[key] = load_target(cfg, **kwargs)
    return _TARGETS[key]


@pytest.fixture(scope="module")
def reference(chat_target, chats, tmp_path_factory) -> Path:
    """One uninterrupted run answering every user turn of the shared chats."""
    out = tmp_path_factory.mktemp("distill_ref")
    _run(distill_argv(chats, out, "turns=all"))
    return out


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


# ------------------------------------------------------------------------ output and resume


def test_reference_output_has_kept_truncated_and_multi_turn_answers(reference, chats):
    convs = rows(reference / "conversations.jsonl")
    m = json.loads((reference / "distill_manifest.json").read_text())
    assert m["complete"] and m["num_prompts"] == 30 and m["turns"] == "all"
    assert m["counts"]["kept"] == len(convs) > 20
    assert 0 < m["counts"]["truncated"] < len(convs)  # both cut and self-ended answers
    assert m["counts"]["answers"] > len(convs)  # some conversations go past turn 1
    assert m["sampling"]["temperature"] == 0.0 and m["target"]["name"] == "tiny_chat"
    assert m["generated_tokens"] > 0 and len(m["tokenizer"]["chat_template_sha256"]) == 64
    sources = {json.loads(line)["id"]: json.loads(line)["conversations"]
               for line in chats.read_text().splitlines()}
    for c in convs:
        assert set(c) == {"id", "messages", "truncated", "source", "generated_tokens"}
        assert c["source"] == str(chats)
        roles = [t["role"] for t in c["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        users = [t["value"] for t in sources[c["id"]] if t["from"] == "human"]
        assert [t["content"] for t in c["messages"][::2]] == users[:len(roles) // 2]
        gpt = {t["value"] for t in sources[c["id"]] if t["from"] == "gpt"}
        assert not gpt & {t["content"] for t in c["messages"][1::2]}  # the target's own
        # A conversation stops at a cut answer: only its last answer may be cut.
        assert c["truncated"] or len(roles) // 2 == len(users)
    assert not [p.name for p in reference.iterdir() if p.name.startswith(".")]


def test_sigkill_mid_run_resumes_without_answering_twice(chats, reference, tmp_path):
    out = tmp_path / "distill"
    argv = distill_argv(chats, out, "turns=all")
    live = out / "conversations.jsonl"
    run_until(argv, JOB_ENV, lambda pid: _lines(live) >= 1)
    assert not (out / "distill_manifest.json").exists(), "the kill should land mid-run"
    rejects = out / ".rejects.rank0.jsonl"
    done_ids = [r["id"] for r in rows(live)] + [r["id"] for r in (rows(rejects) if
                                                                 rejects.exists() else [])]
    assert len(done_ids) == len(set(done_ids)), "an answer was written twice"
    assert "chat29" not in done_ids  # its batch, the last, had not started
    # A kill in the middle of a batch's write leaves half a line behind: the resume must drop
    # it, not take chat29 as answered, and append after it on a fresh line.
    with open(live, "ab") as f:
        f.write(b'{"id": "chat29", "messages": [{"role": "user", "con')
    unfinished = compose("precompute", PrecomputeConfig, [
        *TINY, "data=jsonl", f"data.path={live}", f"output_dir={tmp_path / 'shards'}"])
    with pytest.raises(ValueError, match="has not finished"):
        precompute_run.main(unfinished)

    proc = _run(argv)
    assert f"{len(done_ids)} of 30 prompts already answered; answering {30 - len(done_ids)}" \
        in proc.stdout
    for name in ("conversations.jsonl", "rejects.jsonl", "distill_manifest.json"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_torchrun_ranks_split_the_prompts_and_rank0_merges(chats, tmp_path):
    # One prompt per batch, so one process and two ranks run the very same requests.
    single, ranked = tmp_path / "single", tmp_path / "ranked"
    extra = ["data.limit=10", "engine.max_batch_size=1"]
    distill_run.main(distill_cfg(chats, single, *extra))
    job = distill_argv(chats, ranked, *extra)[3:]  # drop `python -m precompute.distill`
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", "2", "-m", "precompute.distill", *job])
    assert "distill[0]: 0 of 5 prompts" in proc.stdout
    assert "distill[1]: 0 of 5 prompts" in proc.stdout
    assert proc.stdout.count("distill done") == 1
    for name in ("conversations.jsonl", "rejects.jsonl"):
        assert (ranked / name).read_bytes() == (single / name).read_bytes(), name
    m = json.loads((ranked / "distill_manifest.json").read_text())
    assert m["world_size"] == 2 and m["counts"] == json.loads(
        (single / "distill_manifest.json").read_text())["counts"]
    assert not [p.name for p in ranked.iterdir() if p.name.startswith(".")]


def test_rerun_after_completion_generates_nothing(chats, reference, tmp_path, monkeypatch,
                                                  capsys):
    out = tmp_path / "distill"
    out.mkdir()
    for p in reference.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    before = snapshot(out)
    monkeypatch.setattr(LLMEngine, "generate", no_generation)
    m = distill_run.main(distill_cfg(chats, out, "turns=all"))
    assert m.complete and snapshot(out) == before
    assert "nothing to do" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"different plan.*overwrite=true"):
        distill_run.main(distill_cfg(chats, out, "turns=first"))
    assert snapshot(out) == before


# ------------------------------------------------------------------------ precompute reads it


def test_precompute_trains_no_end_of_turn_after_a_truncated_answer(reference, tmp_path):
    convs = {c["id"]: c for c in rows(reference / "conversations.jsonl")}
    out = tmp_path / "shards"
    cfg = compose("precompute", PrecomputeConfig, [
        *TINY, "data=jsonl", f"data.path={reference / 'conversations.jsonl'}",
        "progress=false", f"output_dir={out}"])
    manifest = precompute_run.main(cfg)
    seen = {True: 0, False: 0}
    for e in manifest.shards:
        shard = read_shard(out / e.file, e.sha256)
        for i, rid in enumerate(shard.record_ids):
            a, b = int(shard.cu_seqlens[i]), int(shard.cu_seqlens[i + 1])
            ids, mask = shard.input_ids[a:b].tolist(), shard.loss_mask[a:b].tolist()
            last = max(k for k, m in enumerate(mask) if m)
            answers = len(convs[rid]["messages"]) // 2
            ends = [k for k, t in enumerate(ids) if t == IM_END and mask[k]]
            if convs[rid]["truncated"]:
                # The template still renders <|im_end|> after the cut answer; it is not learned.
                assert ids[last + 1] == IM_END and mask[last + 1] == 0
                assert len(ends) == answers - 1
            else:
                assert ids[last] == IM_END and len(ends) == answers
            seen[convs[rid]["truncated"]] += 1
    assert seen[True] and seen[False]


def test_data_regenerate_runs_the_stage_once_then_reuses_it(chats, tmp_path, monkeypatch):
    out = tmp_path / "shards"
    cfg = compose("precompute", PrecomputeConfig, [
        *TINY, "data=jsonl", f"data.path={chats}", "data.limit=8", "data.regenerate=true",
        "data.regen_max_new_tokens=12", "shard_tokens=600", "progress=false",
        f"output_dir={out}"])
    manifest = precompute_run.main(cfg)
    distilled = rows(out / "distill" / "conversations.jsonl")
    assert manifest.data["regeneration"]["counts"]["kept"] == len(distilled)
    assert manifest.data["load_report"]["kept"] == len(distilled)
    assert len(manifest.shards) > 1
    shard0 = (out / manifest.shards[0].file).read_bytes()

    monkeypatch.setattr(LLMEngine, "generate", no_generation)
    before = snapshot(out)
    assert precompute_run.main(cfg).shards == manifest.shards  # a rerun
    assert snapshot(out) == before
    (out / manifest.shards[0].file).unlink()  # a resume
    assert precompute_run.main(cfg).shards == manifest.shards
    assert (out / manifest.shards[0].file).read_bytes() == shard0


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
    generate = LLMEngine.generate

    def spy(self, prompts, *a, **k):
        asked.extend(prompts)
        return generate(self, prompts, *a, **k)

    monkeypatch.setattr(LLMEngine, "generate", spy)
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
    generate = LLMEngine.generate

    def spy(self, prompts, *a, **k):
        asked.append(list(prompts))
        return generate(self, prompts, *a, **k)

    monkeypatch.setattr(LLMEngine, "generate", spy)
    out = tmp_path / "out"
    # Every 11th token ends an answer: in 64 tokens turn 1 ends by itself.
    distill_run.main(distill_cfg(data, out, "turns=all", "sampling.max_new_tokens=64"))
    (conv,) = rows(out / "conversations.jsonl")
    u1, a1, u2, a2 = conv["messages"]
    assert (u1["content"], u2["content"]) == ("Why is the sky blue?", "And sunsets?")
    assert a1["content"] != "Rayleigh scattering." and not conv["truncated"]
    tok = load_tokenizer(distill_cfg(data, out).target)
    assert asked[1] == [encode_prompt(tok, [u1, a1, u2], chat=True)]

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
