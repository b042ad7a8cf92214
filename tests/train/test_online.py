"""Online training (train/online.py): the head trained online is bit-identical (CPU, fp32
target) to the head trained from shards of the same data, at 1 and 2 gloo ranks, with and
without regeneration; a SIGKILL and resume changes nothing; bad input stops before training."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO, cli_env  # tests/train/conftest.py

WORDS = "the draft head reads hidden states of the target and proposes tokens".split()
TINY = ["target=tiny", "target.arch.tie_word_embeddings=false"]  # answers are not empty
TRAIN = ["trainer.wandb=disabled", "validation.enabled=false", "trainer.progress=false",
         "trainer.log_every=1", "trainer.device=cpu", "data.batch_tokens=256",
         "trainer.max_steps=6", "optim.warmup_steps=1", "trainer.save_every=2"]
PACK = ["data.shard_tokens=700", "data.forward_tokens=400"]  # precompute's shard/batch_tokens


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("online") / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(10):
            turns = [{"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))},
                     {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(10, 90)))}]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return path


def run(module: str, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    from conftest import free_port

    launch = [sys.executable, "-m", module] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", module]
    proc = subprocess.run([*launch, *args], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=600)
    return proc


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def same_head(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not wa[k].equal(wb[k])]
    assert not differ, f"heads differ in {differ}"


def source(chats: Path, *extra: str) -> list[str]:
    return ["data.online=true", "source=jsonl", f"source.path={chats}", "source.max_length=200",
            *extra]


@pytest.mark.parametrize("target,nproc,head", [
    (TINY, 1, []), (TINY, 2, []), (["target=smollm2"], 1, []),
    (TINY, 1, ["head=dflash", "head.num_steps=3", "head.markov_rank=4"])],
    ids=["tiny-1rank", "tiny-2ranks", "smollm2-1rank", "tiny-dflash"])
def test_online_equals_training_from_shards(chats, tmp_path, target, nproc, head):
    """The dflash case reads auxiliary layers: online, data.aux=auto captures the EAGLE-3
    layers it needs (the shards are precomputed with aux=eagle3)."""
    shards = tmp_path / "shards"
    aux = ["aux=eagle3"] if head else []
    ok(run("precompute", *target, "data=jsonl", f"data.path={chats}", "data.max_length=200",
           "data.limit=6", "shard_tokens=700", "batch_tokens=400", "progress=false", *aux,
           f"output_dir={shards}"))
    ok(run("train", *target, *TRAIN, *head, f"data.shards={shards}",
           f"output_dir={tmp_path / 'off'}", nproc=nproc))
    proc = ok(run("train", *target, *TRAIN, *PACK, *head, *source(chats, "source.limit=6"),
                  f"output_dir={tmp_path / 'on'}", nproc=nproc))
    assert "no hidden states written" in proc.stdout
    same_head(tmp_path / "off", tmp_path / "on")


@pytest.mark.parametrize("nproc", [1, 2])
def test_online_regeneration_equals_one_pass_distill_shards(chats, tmp_path, nproc):
    regen = ["source.limit=5", "source.regenerate=true", "source.regen_max_new_tokens=12",
             "engine.max_batch_size=2"]
    shards = tmp_path / "shards"
    ok(run("precompute", *TINY, "data=jsonl", f"data.path={chats}", "data.max_length=200",
           "data.limit=5", "data.regenerate=true", "data.regen_max_new_tokens=12",
           "engine.max_batch_size=2", "shard_tokens=700", "progress=false",
           f"output_dir={shards}", nproc=nproc))
    ok(run("train", *TINY, *TRAIN, f"data.shards={shards}", f"output_dir={tmp_path / 'off'}",
           nproc=nproc))
    ok(run("train", *TINY, *TRAIN, "data.shard_tokens=700", *source(chats, *regen),
           f"output_dir={tmp_path / 'on'}", nproc=nproc))
    same_head(tmp_path / "off", tmp_path / "on")


def test_sigkill_then_resume_gives_the_uninterrupted_head(chats, tmp_path):
    args = [*TINY, *TRAIN, *PACK, *source(chats, "source.limit=6"), "trainer.max_steps=8"]
    ok(run("train", *args, f"output_dir={tmp_path / 'whole'}"))
    out = tmp_path / "killed"
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "train", *args, f"output_dir={out}"],
                                cwd=REPO, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / "step_00000004").is_dir():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (out / "model.safetensors").exists()
    resumed = ok(run("train", *args, f"output_dir={out}"))
    assert "resuming from" in resumed.stdout + resumed.stderr
    same_head(tmp_path / "whole", out)


def test_no_trainable_record_stops_with_one_line(chats, tmp_path):
    proc = run("train", *TINY, *TRAIN, *source(chats, "source.max_length=2"),
               f"output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "no trainable record" in lines[0] and "too_short" in lines[0]
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_a_warm_start_head_of_another_target_stops_before_training(chats, tmp_path):
    other = tmp_path / "other"
    ok(run("train", *TINY, "target.seed=1", *TRAIN, "trainer.max_steps=1",
           *source(chats, "source.limit=2"), f"output_dir={other}"))
    proc = run("train", *TINY, *TRAIN, *source(chats, "source.limit=2"),
               f"trainer.init_from={other}", f"output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "trainer.init_from" in lines[0] and "other target" in lines[0]
    assert "online data" not in proc.stdout  # stopped before the target ran over the data


def test_an_aux_head_online_without_aux_layers_stops_with_one_line(chats, tmp_path):
    proc = run("train", *TINY, *TRAIN, "head=dflash", "data.aux=none",
               *source(chats, "source.limit=2"), f"output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "data.aux=none" in lines[0] and "data.aux=auto" in lines[0]
    assert not (tmp_path / "o" / "checkpoints").exists()
