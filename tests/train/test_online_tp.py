"""Online training at engine.tensor_parallel=2 (train/online_tp.py): the head equals, bit for
bit, the head trained (data parallel, same ranks) from shards that `torchrun -m precompute`
writes at engine.tensor_parallel=2, with and without regeneration, at 2 ranks (one group) and
4 (two groups); a launch that cannot split stops with one line before any work.

Why that comparison and not T=1's: split in two, the fp32 target sums its row-parallel
products in another order (two partial GEMMs, then the all-reduce), so its states may differ
from T=1's in the last bits, which bf16 rounding mostly, not always, hides
(tests/precompute/test_tp_precompute.py). Precompute at T=2 runs the same forwards (the
same plan's batches through precompute.dump.forward_batch over a LeaderModel, the followers
with dump_engine's settings; with regeneration the same distill batches and seeds), so its
shards hold exactly the states online training at T=2 computes: equality must be exact.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, cli_env  # tests/train/conftest.py
from test_online import PACK, TINY, TRAIN, chats, ok, run, same_head, source  # noqa: F401

TP2 = "engine.tensor_parallel=2"
PRE = ["data=jsonl", "data.max_length=200", "data.limit=6", "shard_tokens=700",
       "batch_tokens=400", "progress=false"]


@pytest.fixture(scope="module")
def tp2_shards(chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2") / "shards"
    ok(run("precompute", *TINY, *PRE, f"data.path={chats}", TP2, f"output_dir={out}",
           nproc=2))
    return out


@pytest.mark.parametrize("nproc", [2, 4], ids=["1group", "2groups"])
def test_online_at_tp2_equals_training_from_tp2_shards(chats, tp2_shards, tmp_path, nproc):
    # Shards at T=2 are the same bytes whatever the number of replicas (test_tp_precompute).
    ok(run("train", *TINY, *TRAIN, f"data.shards={tp2_shards}",
           f"output_dir={tmp_path / 'off'}", nproc=nproc))
    proc = ok(run("train", *TINY, *TRAIN, *PACK, *source(chats, "source.limit=6"), TP2,
                  f"output_dir={tmp_path / 'on'}", nproc=nproc))
    assert proc.stdout.count("no hidden states written") == 1  # rank 0 reports
    same_head(tmp_path / "off", tmp_path / "on")


@pytest.mark.parametrize("nproc", [2, 4], ids=["1group", "2groups"])
def test_online_regeneration_at_tp2_equals_tp2_one_pass_shards(chats, tmp_path, nproc):
    """Two groups answer the distill split of two ranks (prompts i % 2): their records
    gathered in batch order are the shards' of a T=2 x DP=2 precompute."""
    regen = ["source.limit=5", "source.regenerate=true", "source.regen_max_new_tokens=12",
             "engine.max_batch_size=2"]
    shards = tmp_path / "shards"
    ok(run("precompute", *TINY, "data=jsonl", f"data.path={chats}", "data.max_length=200",
           "data.limit=5", "data.regenerate=true", "data.regen_max_new_tokens=12",
           "engine.max_batch_size=2", "shard_tokens=700", "progress=false", TP2,
           f"output_dir={shards}", nproc=nproc))
    ok(run("train", *TINY, *TRAIN, f"data.shards={shards}", f"output_dir={tmp_path / 'off'}",
           nproc=nproc))
    proc = ok(run("train", *TINY, *TRAIN, "data.shard_tokens=700", *source(chats, *regen), TP2,
                  f"output_dir={tmp_path / 'on'}", nproc=nproc))
    assert "answered and captured" in proc.stdout
    same_head(tmp_path / "off", tmp_path / "on")


def test_tp_without_torchrun_is_one_line_before_any_work(chats, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "train", *TINY, *TRAIN,
                           *source(chats, "source.limit=2"), TP2,
                           f"output_dir={tmp_path / 'o'}"],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "engine.tensor_parallel=2 needs one process per rank from " \
                               "torchrun" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "online data" not in proc.stdout


def test_a_world_tp_does_not_divide_stops_every_rank(chats, tmp_path):
    proc = run("train", *TINY, *TRAIN, *source(chats, "source.limit=2"),
               "engine.tensor_parallel=3", f"output_dir={tmp_path / 'o'}", nproc=2)
    assert proc.returncode != 0
    line = "error: engine.tensor_parallel=3 does not divide the world size 2"
    assert proc.stderr.count(line) == 2, proc.stderr[-3000:]  # one line per rank
    assert "online data" not in proc.stdout
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_validation_on_the_online_shard_leaves_the_head_unchanged(chats, tmp_path):
    """Validation at T=2 beside online training at T=2 runs on the online source's groups and
    shard (no second copy: train/loop.py hands it over) and measures real τ at each eval
    step, and the head is the one trained without validation: serving the validator's engine
    between micro-batches leaves the states the leader computes next untouched."""
    val = ["validation.enabled=true", "validation.num_conversations=2", "validation.max_length=96",
           "validation.tau_prompts=2", "validation.tau_max_new_tokens=8", "trainer.eval_every=3",
           "engine.num_pages=64"]
    args = [*TINY, *TRAIN, *PACK, *source(chats, "source.limit=6"), TP2]
    ok(run("train", *args, f"output_dir={tmp_path / 'plain'}", nproc=2))
    ok(run("train", *args, *val, f"output_dir={tmp_path / 'val'}", nproc=2))
    same_head(tmp_path / "plain", tmp_path / "val")
    lines = (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()
    assert sum('"val/real_tau"' in line for line in lines) == 2  # steps 3 and 6
