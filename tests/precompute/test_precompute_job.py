"""The precompute job end to end on the tiny target (in process): bad input, rejects, dry run,
reruns into the same directory, and what the shards and manifest hold."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import precompute.run as run
from inference_eval.hydra_app import compose
from precompute.config import PrecomputeConfig
from precompute.manifest import Manifest
from precompute.shard_io import read_shard

GOOD = [{"id": f"good{i}", "conversations": [
    {"from": "human", "value": f"Question {i}: " + "why is the sky blue? " * (i + 1)},
    {"from": "gpt", "value": "Because of Rayleigh scattering. " * (3 * i + 2)}]} for i in range(8)]
BAD_LINES = [  # (raw JSONL line, reason, id the rejects file must carry)
    ('{"id": "cut1", "conversations": [{"from": "human"', "invalid_json", "cut1"),
    ('[1, 2]', "not_an_object", "chats.jsonl:3"),  # no id: file:line
    ('{"id": "norole", "conversations": [{"value": "hi"}, {"from": "gpt", "value": "yo"}]}',
     "missing_role", "norole"),
    ('{"id": "alien", "conversations": [{"from": "martian", "value": "hi"}]}', "unknown_role",
     "alien"),
    ('{"id": "num", "conversations": [{"from": "human", "value": 5}, '
     '{"from": "gpt", "value": "x"}]}', "non_string_content", "num"),
    ('{"id": "blank", "conversations": [{"from": "human", "value": "  "}, '
     '{"from": "gpt", "value": "x"}]}', "empty_turn", "blank"),
    ('{"id": "mute", "conversations": [{"from": "human", "value": "hello?"}]}',
     "no_assistant_turn", "mute"),
    (json.dumps({"id": "longq", "conversations": [{"from": "human", "value": "word " * 400},
                                                  {"from": "gpt", "value": "ok"}]}),
     "too_short", "longq"),
]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    lines = [json.dumps(r) for r in GOOD[:8]]
    lines[1:1] = [b[0] for b in BAD_LINES]  # bad records in between good ones
    path.write_text("\n".join(lines) + "\n")
    return path


def config(chats: Path, out: Path, *overrides: str) -> PrecomputeConfig:
    return compose("precompute", PrecomputeConfig, [
        "target=tiny", "data=jsonl", f"data.path={chats}", "data.max_length=256",
        "shard_tokens=300", "progress=false", f"output_dir={out}", *overrides])


@pytest.fixture(scope="module")
def done(chats, tmp_path_factory):
    """One completed run: (output dir, manifest, what it printed)."""
    out = tmp_path_factory.mktemp("done") / "shards"
    manifest = run.main(config(chats, out))
    return out, manifest


def snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())}


def no_model(*_a, **_k):
    raise AssertionError("the target should not be loaded here")


def test_missing_input_names_the_path_before_loading_the_target(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "load_target", no_model)
    missing = tmp_path / "nowhere" / "chats.jsonl"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        run.main(config(missing, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_malformed_records_are_counted_by_reason_and_listed_with_ids(done):
    out, manifest = done
    want = {reason: 1 for _, reason, _ in BAD_LINES}
    assert manifest.data["load_report"]["rejected"] == want
    assert manifest.data["load_report"]["kept"] == len(GOOD)
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    got = sorted((r["id"], r["reason"]) for r in rejects)
    assert got == sorted((rid, reason) for _, reason, rid in BAD_LINES)
    assert all(r["detail"] for r in rejects)


def test_shards_hold_the_kept_records_in_order_and_verify(done):
    out, manifest = done
    assert manifest.complete and len(manifest.shards) == manifest.num_planned_shards > 2
    on_disk = Manifest.load(out / "manifest.json")
    assert on_disk.shards == manifest.shards
    ids, tokens = [], 0
    for e in on_disk.shards:
        shard = read_shard(out / e.file, e.sha256)
        assert (e.tokens, e.sequences, e.loss_tokens) == (
            shard.input_ids.numel(), shard.num_sequences, int(shard.loss_mask.sum()))
        ids += shard.record_ids
        tokens += e.tokens
    assert ids == [r["id"] for r in GOOD]
    assert tokens == on_disk.num_tokens
    assert on_disk.hidden_convention == "last_layer_pre_final_norm"
    assert on_disk.target["name"] == "tiny" and len(on_disk.target["weights_sha256"]) == 64
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_dry_run_prints_tokens_and_bytes_and_writes_nothing(chats, done, tmp_path, monkeypatch,
                                                            capsys):
    monkeypatch.setattr(run, "load_target", no_model)  # counts need the tokenizer only
    out = tmp_path / "dry"
    assert run.main(config(chats, out, "dry_run=true")) is None
    assert not out.exists() and not list(tmp_path.iterdir())
    printed = capsys.readouterr().out
    assert "dry run, nothing written" in printed
    summary = json.loads(printed.strip().splitlines()[-1])
    real_out, manifest = done
    assert summary["tokens"] == manifest.num_tokens and summary["records"] == len(GOOD)
    assert summary["shards"] == len(manifest.shards)
    assert summary["bytes_per_token"] == 2 * 64 + 5
    real_bytes = sum((real_out / e.file).stat().st_size for e in manifest.shards)
    assert 0 < real_bytes - summary["bytes_estimate"] < 1024 * len(manifest.shards)  # headers


def test_rerun_after_completion_is_a_no_op(chats, done, capsys):
    out, manifest = done
    before = snapshot(out)
    again = run.main(config(chats, out))
    assert snapshot(out) == before
    assert again.shards == manifest.shards
    assert "nothing to do" in capsys.readouterr().out


def test_rerun_resumes_only_the_missing_shard(chats, done, tmp_path):
    out = tmp_path / "shards"
    shutil.copytree(done[0], out)
    before = snapshot(out)
    (out / "shard_00001.safetensors").unlink()
    run.main(config(chats, out))
    after = snapshot(out)
    assert after["shard_00001.safetensors"][1] == before["shard_00001.safetensors"][1]
    for name in ("shard_00000.safetensors", "shard_00002.safetensors"):
        assert after[name] == before[name]  # untouched, same mtime


def test_other_plan_in_the_same_dir_is_refused_then_overwrite_replaces_it(chats, done, tmp_path):
    out = tmp_path / "shards"
    shutil.copytree(done[0], out)
    before = snapshot(out)
    with pytest.raises(ValueError, match=r"different plan.*overwrite=true"):
        run.main(config(chats, out, "shard_tokens=2000"))
    assert snapshot(out) == before
    (out / ".shard_00009.safetensors.tmp").write_bytes(b"left by a kill")
    manifest = run.main(config(chats, out, "shard_tokens=2000", "overwrite=true"))
    assert len(manifest.shards) < len(done[1].shards)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([e.file for e in manifest.shards] + ["manifest.json", "rejects.jsonl"])
    assert Manifest.load(out / "manifest.json").plan_hash == manifest.plan_hash != done[1].plan_hash
