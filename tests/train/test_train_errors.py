"""Bad input stops with an error that says what is wrong, before the first training step:
nothing is logged or checkpointed."""
from __future__ import annotations

import json
import shutil

import pytest

from inference_eval.hydra_app import compose
from train.config import TrainConfig
from train.loop import train


def _cfg(common, shards, out, *extra):
    return compose("train", TrainConfig, [*common, f"data.shards={shards}", f"output_dir={out}",
                                          "trainer.max_steps=2", *extra])


def _assert_nothing_trained(out):
    assert not (out / "metrics.jsonl").exists()
    assert not (out / "checkpoints").exists()
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("extra, match", [
    (["target.seed=1"], "different target weights"),  # same arch, other weights
    (["target.arch.vocab_size=256"], "were made from target 'tiny-v300'"),
    (["target.arch.hidden_size=32", "target.arch.head_dim=8"], r"hidden 64\), not from"),
])
def test_shards_of_another_target_are_refused(extra, match, shards, common, tmp_path):
    with pytest.raises(ValueError, match=match):
        train(_cfg(common, shards, tmp_path / "out", *extra))
    _assert_nothing_trained(tmp_path / "out")


def test_missing_shard_file(shards_copy, common, tmp_path):
    (shards_copy / "shard_00001.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard .*shard_00001.safetensors is missing"):
        train(_cfg(common, shards_copy, tmp_path / "out"))
    _assert_nothing_trained(tmp_path / "out")


def test_missing_manifest(shards_copy, common, tmp_path):
    (shards_copy / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no manifest at"):
        train(_cfg(common, shards_copy, tmp_path / "out"))


def test_corrupted_shard(shards_copy, common, tmp_path):
    f = shards_copy / "shard_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside the hidden states
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"shard_00000.safetensors is corrupt"):
        train(_cfg(common, shards_copy, tmp_path / "out"))
    _assert_nothing_trained(tmp_path / "out")


def test_resume_from_another_head_type(shards, common, tmp_path):
    out = tmp_path / "out"
    train(_cfg(common, shards, out, "head=medusa", "trainer.save_every=1"))
    shutil.rmtree(out / "checkpoints" / "step_00000001")  # keep latest (step 2) only
    lines = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="holds a 'medusa' head, but head.type='mtp'"):
        train(_cfg(common, shards, out, "head=mtp", "trainer.max_steps=4"))
    assert (out / "metrics.jsonl").read_text() == lines  # not one step of mtp ran


@pytest.mark.parametrize("damaged", ["state.json", "optimizer.safetensors",
                                     "head/model.safetensors"])
def test_damaged_resume_checkpoint_names_the_file(damaged, shards, common, tmp_path):
    """A checkpoint file cut short (a kill mid-write outside the atomic rename, a full disk)
    stops the resume with the file named and what to do, not a parser's traceback."""
    out = tmp_path / "out"
    train(_cfg(common, shards, out, "trainer.save_every=1"))
    root = out / "checkpoints"
    f = root / (root / "latest").read_text().strip() / damaged
    f.write_bytes(f.read_bytes()[:20])
    with pytest.raises(ValueError, match=rf"{damaged.split('/')[-1]} is not .*delete that checkpoint"):
        train(_cfg(common, shards, out, "trainer.max_steps=4"))
    shutil.rmtree(f.parents[len(damaged.split("/")) - 1])  # what the message says to do
    train(_cfg(common, shards, out, "trainer.max_steps=4"))  # resumes from step 1
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-3:] == [2, 3, 4] and steps.count(2) == 2  # step 2 ran again, once more


def test_damaged_head_config_names_the_file(tmp_path):
    from heads.checkpoint import read_head_config

    (tmp_path / "config.json").write_text('{"format": "specheads-head-v1", "head": {')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        read_head_config(tmp_path)


@pytest.mark.parametrize("override, match", [
    ("trainer.strategy=bogus", "trainer.strategy='bogus'"),
    ("head.type=bogus", "head.type='bogus'"),
    ("optim.lr=-1", "optim.lr must be > 0"),
    ("optim.grad_accum=0", "optim.grad_accum"),
    ("trainer.log_every=0", "trainer.log_every"),
    ("data.batch_tokens=0", "data.batch_tokens"),
    ("head.num_steps=0", "head.num_steps"),
    ("target.source=bogus", "target.source='bogus'"),
])
def test_invalid_config_value_names_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        compose("train", TrainConfig, [override])


def test_cli_config_error_exits_2_before_any_work(run_train, tmp_path):
    r = run_train("trainer.strategy=bogus", f"output_dir={tmp_path / 'out'}", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "config error: trainer.strategy='bogus'" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_cli_data_error_fails_before_training(shards_copy, run_train, common, tmp_path):
    (shards_copy / "shard_00000.safetensors").write_bytes(b"not a shard")
    r = run_train(*common, f"data.shards={shards_copy}", f"output_dir={tmp_path / 'out'}",
                  timeout=120)
    assert r.returncode != 0
    assert "shard_00000.safetensors is corrupt" in r.stderr
    _assert_nothing_trained(tmp_path / "out")


def test_fsdp_where_accelerate_does_not_shard_is_refused(shards, run_train, common, tmp_path):
    """Without CUDA accelerate sets up no FSDP (tests/train/fsdp_cpu.py makes it shard on gloo
    for the FSDP test); the trainer asks it what it set up and stops, naming the fix."""
    r = run_train(*common, f"data.shards={shards}", "trainer.strategy=fsdp",
                  f"output_dir={tmp_path / 'out'}", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("error: trainer.strategy=fsdp but accelerate set up NO; use trainer.strategy=ddp on "
            "the CPU") in r.stderr
    _assert_nothing_trained(tmp_path / "out")
