"""The data position is counted in global micro-batches, so a checkpoint means the same samples
on any world size; a resume that would change the global batch (world size x grad_accum
micro-batches of data.batch_tokens) or the packing stops with an error naming both values.

One process fakes another world size by editing the saved metadata (state.json "run");
tests/train/test_train_fsdp.py resumes a real 2-rank checkpoint on one process."""
from __future__ import annotations

import json

import pytest
import torch

from inference_eval.hydra_app import compose
from train.config import TrainConfig
from train.data import MicroBatchStream, ShardStore, draw_seed
from train.loop import train
from train.state import RunShape, check_resume


def test_rank_streams_interleave_into_the_one_process_stream_across_epochs(shards):
    store = ShardStore(shards)
    per_epoch = len(store.batches(128, 0, 0))
    one = MicroBatchStream(store, 128, 0, 0, 1)
    want = [one.next() for _ in range(3 * per_epoch + 1)]  # into the fourth epoch
    assert one.epoch == 3 and one.position == len(want)
    ranks = [MicroBatchStream(store, 128, 0, r, 2) for r in range(2)]
    got = [ranks[j % 2].next() for j in range(len(want) - 1)]
    assert got == want[:-1]
    assert ranks[0].position == ranks[1].position == len(want) - 1
    assert (ranks[0].last_index, ranks[1].last_index) == (len(want) - 3, len(want) - 2)
    # Resuming: rank 1 of 2 at global position 2 * per_epoch continues in epoch 2.
    later = MicroBatchStream(store, 128, 0, 1, 2, position=2 * per_epoch)
    assert later.next() == want[2 * per_epoch + 1] and later.epoch == 2
    with pytest.raises(ValueError, match="not a multiple of the world size 2"):
        MicroBatchStream(store, 128, 0, 0, 2, position=3)


def test_draw_seeds_are_distinct_per_micro_batch_and_fit_a_generator():
    seeds = {draw_seed(s, i) for s in (0, 1, 7) for i in range(1000)}
    assert len(seeds) == 3000
    for s in (-3, 2**40, 123456789123):  # any int seed gives a seed torch takes
        torch.Generator().manual_seed(draw_seed(s, 5))
    assert draw_seed(2**40, 5) == draw_seed(2**40, 5)


def _cfg(common, shards, out, *extra):
    return compose("train", TrainConfig, [*common, f"data.shards={shards}", f"output_dir={out}",
                                          "trainer.save_every=1", *extra])


def _edit_run(out, **changes):
    ck = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((ck / "state.json").read_text())
    meta["run"].update(changes)
    (ck / "state.json").write_text(json.dumps(meta))
    return meta


def test_resume_on_another_world_size_keeps_or_refuses_the_global_batch(shards, common, tmp_path):
    out = tmp_path / "out"
    train(_cfg(common, shards, out, "trainer.max_steps=2"))
    meta = _edit_run(out, world_size=2)  # as if two ranks with grad_accum 1 had written it
    assert meta["run"]["grad_accum"] == 1 and meta["data_position"] == 2 and meta["step"] == 2
    lines = (out / "metrics.jsonl").read_text()

    msg = (r"world size 2 x optim.grad_accum 1 = 2 micro-batches per optimizer step; this run "
           r"has world size 1 x optim.grad_accum 1 = 1; set optim.grad_accum=2 to keep it")
    with pytest.raises(ValueError, match=msg):
        train(_cfg(common, shards, out, "trainer.max_steps=4"))
    assert (out / "metrics.jsonl").read_text() == lines  # not one step ran
    with pytest.raises(ValueError, match=r"data.batch_tokens=128 .* this run has 64"):
        train(_cfg(common, shards, out, "trainer.max_steps=4", "optim.grad_accum=2",
                   "data.batch_tokens=64"))

    # Same global batch on one rank: continues at step 3 from global micro-batch 2.
    train(_cfg(common, shards, out, "trainer.max_steps=4", "optim.grad_accum=2"))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    meta = json.loads((out / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert meta["data_position"] == 2 + 2 * 2
    assert meta["run"] == {"world_size": 1, "grad_accum": 2, "batch_tokens": 128, "seed": 0,
                           "strategy": "none"}


def test_older_checkpoint_format_is_refused(shards, common, tmp_path):
    out = tmp_path / "out"
    train(_cfg(common, shards, out, "trainer.max_steps=1"))
    ck = out / "checkpoints" / "step_00000001"
    meta = json.loads((ck / "state.json").read_text())
    del meta["format"]
    (ck / "state.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="written by an older trainer"):
        train(_cfg(common, shards, out, "trainer.max_steps=2"))


@pytest.mark.parametrize("saved, now, match", [
    (RunShape(4, 1, 128, 0, "deepspeed"), RunShape(2, 2, 128, 0, "deepspeed"),
     "ZeRO-2 optimizer partitions of world size 4, this run has world size 2"),
    (RunShape(2, 1, 128, 0, "deepspeed"), RunShape(2, 1, 128, 0, "fsdp"),
     "written with trainer.strategy=deepspeed, this run uses fsdp"),
    (RunShape(2, 2, 128, 0, "ddp"), RunShape(8, 1, 128, 0, "fsdp"),
     r"= 4 micro-batches .* world size 8 x optim.grad_accum 1 = 8; or start"),
    (RunShape(2, 2, 128, 0, "ddp"), RunShape(2, 2, 128, 1, "ddp"), "trainer.seed=0"),
])
def test_check_resume_names_both_values(saved, now, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        check_resume(tmp_path, saved, now)


def test_check_resume_accepts_strategy_and_world_changes_with_the_same_global_batch(tmp_path):
    check_resume(tmp_path, RunShape(2, 2, 128, 0, "fsdp"), RunShape(4, 1, 128, 0, "ddp"))
    check_resume(tmp_path, RunShape(2, 2, 128, 0, "ddp"), RunShape(1, 4, 128, 0, "none"))
