"""The self-distillation stage (`python -m precompute.distill`): the tiny chat target of
distill_helpers answers prompts through the engine; answers are cached, resumable after
SIGKILL, and read by precompute with the truncated flag honoured (inputs and bad records:
test_distill_inputs.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kill_point import run_until

import precompute.distill.run as distill_run
import precompute.run as precompute_run
from inference_eval.hydra_app import compose
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.prompt_encoding import encode_prompt
from precompute.data import load_prompts
from precompute.distill.answer import CUT, _start
from precompute.config import PrecomputeConfig
from precompute.shard_io import read_shard
from distill_helpers import (IM_END, JOB_ENV, TINY, _run, chat_target, distill_argv,  # noqa: F401
                             distill_cfg, no_generation, rows, shared_targets, snapshot)


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
    monkeypatch.setattr(LLMEngine, "add_request", no_generation)
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

    monkeypatch.setattr(LLMEngine, "add_request", no_generation)
    before = snapshot(out)
    assert precompute_run.main(cfg).shards == manifest.shards  # a rerun
    assert snapshot(out) == before
    # A resume: the shards are the states captured while generating (one pass, no second
    # prefill), so the batch whose shard was lost is answered again, to the same bytes.
    monkeypatch.undo()
    (out / manifest.shards[0].file).unlink()
    assert precompute_run.main(cfg).shards == manifest.shards
    assert (out / manifest.shards[0].file).read_bytes() == shard0


def test_overlapping_batches_answer_as_a_plain_turn_loop(chats, tmp_path, monkeypatch):
    """Next turns queued as answers end and the next batch started while a batch finishes
    (answer.py) give, conversation for conversation, what one prompt at a time answered turn
    by turn through `generate` gives; and the batches did overlap."""
    added, ended, steps = [], [], [0]  # (step, prompt ids) of each request added / ended
    add_request, step = LLMEngine.add_request, LLMEngine.step

    def spy_add(self, prompt_ids, *a, **k):
        added.append((steps[0], list(prompt_ids)))
        return add_request(self, prompt_ids, *a, **k)

    def spy_step(self):
        steps[0] += 1
        done = step(self)
        ended.extend((steps[0], list(r.prompt_ids)) for r in done)
        return done

    monkeypatch.setattr(LLMEngine, "add_request", spy_add)
    monkeypatch.setattr(LLMEngine, "step", spy_step)
    out = tmp_path / "out"
    cfg = distill_cfg(chats, out, "turns=all", "data.limit=8", "engine.max_batch_size=3")
    distill_run.main(cfg)
    monkeypatch.undo()
    convs = rows(out / "conversations.jsonl")
    assert len(convs) >= 6 and any(len(c["messages"]) > 2 for c in convs)

    loaded = distill_run.load_target(cfg.target)
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg.engine)
    for c in convs:
        messages = []
        for i in range(0, len(c["messages"]), 2):
            asked = messages + [c["messages"][i]]
            res = engine.generate([asked], cfg.sampling, chat=True, progress=False)[0]
            messages = asked + [{"role": "assistant", "content": res.text}]
        assert messages == c["messages"], c["id"]
        assert c["truncated"] == (res.finish_reason in CUT), c["id"]
    # Which batch of 3 prompts each request served (a later turn's prompt extends its first
    # turn's): a batch's first request was added before the previous batch's last one ended.
    prompts = load_prompts(cfg.data).conversations
    firsts = []
    for p in prompts:
        d = _start(p, "all")
        firsts.append(encode_prompt(loaded.tokenizer, d.messages + [
            {"role": "user", "content": d.users[0]}], chat=True))

    def by_batch(events):
        out: dict[int, list[int]] = {}
        for s, ids in events:
            (k,) = [k for k, f in enumerate(firsts) if ids[:len(f)] == f]
            out.setdefault(k // 3, []).append(s)
        return out

    starts, ends = by_batch(added), by_batch(ended)
    assert len(starts) == 3 and len(added) == len(ended) > len(prompts)
    assert any(min(starts[b + 1]) < max(ends[b]) for b in (0, 1)), (starts, ends)
